"""The DP engine: per-example clipping without per-example gradients, DP optimizers, Poisson sampling.

- ``engine``: ``PrivacyEngine``, the DP-SGD step (``engine_plan``: its hooks and snapshots; ``settings``: σ, C, q
  checked; ``losses``: per-example losses).
- ``clipping``: per-example clipped sums without per-example gradients; ``norms``: one exact rule per layer kind.
- ``proof``: the start-up probe and the per-step checks that refuse what they cannot prove.
- ``noise``: the DP optimizer, Gaussian and correlated noise, the secret randomness.
- ``sampling``: Poisson, user-level and cyclic samplers; ``sharding``: torchrun and FSDP2.
- ``mechanisms``: eDP-SGD, banded matrix factorization and BLT on the same clipping and proof.

Importing it imports torch; the CLI keeps ``--help`` fast by importing its command's library module only when
the command runs (dptext/cli/).
"""

from __future__ import annotations

from dptext.privacy.mechanisms.blt import BLTEngine
from dptext.privacy.mechanisms.edp import EDPEngine
from dptext.privacy.engine import PrivacyEngine
from dptext.privacy.mechanisms.banded_mf import BandedMFEngine
from dptext.privacy.losses import causal_lm_loss, per_example_loss
from dptext.privacy.noise.optimizer import DPOptimizer
from dptext.privacy.sampling.sampler import PoissonSampler, ShuffleSampler
from dptext.privacy.sampling.user_sampler import UserBatch, UserPoissonSampler

__all__ = ["BLTEngine", "BandedMFEngine", "DPOptimizer", "EDPEngine", "PoissonSampler", "PrivacyEngine",
           "ShuffleSampler", "UserBatch", "UserPoissonSampler", "causal_lm_loss", "per_example_loss"]
