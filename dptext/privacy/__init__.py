"""The DP engine: per-example clipping without per-example gradients, DP optimizers, Poisson sampling.

Exports are lazy so that ``import dptext.privacy`` (and the CLI's --help) does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "PrivacyEngine": "dptext.privacy.engine",
    "EDPEngine": "dptext.privacy.edp",
    "DPOptimizer": "dptext.privacy.optimizer",
    "PoissonSampler": "dptext.privacy.sampler",
    "ShuffleSampler": "dptext.privacy.sampler",
    "UserPoissonSampler": "dptext.privacy.user_sampler",
    "UserBatch": "dptext.privacy.user_sampler",
    "per_example_loss": "dptext.privacy.losses",
    "causal_lm_loss": "dptext.privacy.losses",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dptext.privacy' has no attribute {name!r}")
