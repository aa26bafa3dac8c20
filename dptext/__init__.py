"""dptext: differentially private language models.

Heavy dependencies (torch, transformers) are imported lazily by the modules that need
them, so ``import dptext`` and ``dptext --help`` stay fast.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # ``dptext.PrivacyEngine`` without importing torch at ``import dptext`` time.
    if name == "PrivacyEngine":
        from dptext.privacy.engine import PrivacyEngine

        return PrivacyEngine
    raise AttributeError(f"module 'dptext' has no attribute {name!r}")
