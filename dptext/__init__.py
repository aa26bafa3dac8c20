"""dptext: differentially private language models.

Heavy dependencies (torch, transformers) are imported lazily by the modules that need
them, so ``import dptext`` and ``dptext --help`` stay fast.
"""

__version__ = "0.1.0"
