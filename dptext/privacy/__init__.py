"""The DP engine: per-example clipping without per-example gradients, DP optimizers, Poisson sampling.

Importing it imports torch; the CLI keeps ``--help`` fast by importing its command's library module only when
the command runs (dptext/cli/).
"""

from __future__ import annotations

from dptext.privacy.blt_engine import BLTEngine
from dptext.privacy.edp import EDPEngine
from dptext.privacy.engine import PrivacyEngine
from dptext.privacy.mf_engine import BandedMFEngine
from dptext.privacy.losses import causal_lm_loss, per_example_loss
from dptext.privacy.noise.optimizer import DPOptimizer
from dptext.privacy.sampling.sampler import PoissonSampler, ShuffleSampler
from dptext.privacy.sampling.user_sampler import UserBatch, UserPoissonSampler

__all__ = ["BLTEngine", "BandedMFEngine", "DPOptimizer", "EDPEngine", "PoissonSampler", "PrivacyEngine",
           "ShuffleSampler", "UserBatch", "UserPoissonSampler", "causal_lm_loss", "per_example_loss"]
