"""dptext: differentially private language models.

The package root is light: ``import dptext`` loads nothing else, so ``dptext --help`` stays fast (the CLI
imports each command's library module when the command runs). The layers and what each package owns:
docs/ARCHITECTURE.md; the privacy engine is ``dptext.privacy.PrivacyEngine``.
"""

__version__ = "0.1.0"
