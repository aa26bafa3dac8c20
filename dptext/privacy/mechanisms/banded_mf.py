"""``BandedMFEngine``: the privacy engine with banded matrix-factorization noise (SPEC §12), and
``CorrelatedNoiseEngine``, what it shares with the BLT engine (``privacy/mechanisms/blt.py``).

Everything the DP-SGD engine does stays: exact per-example clipping, its start-up proof and per-step checks, the
secret noise stream, division by the expected batch size. Two things change, and each is tied to the accounting:

* the **noise**: step t's clipped sum gets w_t = (C⁻¹Z)_t (``privacy/noise/correlated.py``) for the banded
  Toeplitz strategy C, instead of a fresh z_t;
* the **sampler**: cyclic balls-in-bins batches (``privacy/sampling/cyclic.py``): each example in one of P bins,
  step t trains bin t mod P, so every example takes part in at most k = ⌈S/P⌉ steps, P apart.

ε is that of one Gaussian mechanism with noise multiplier σ / sens(C), sens computed here from the coefficients
for the sampler's (k, P) schema (``accounting/banded_mf.py``), never taken from the caller. No amplification by
sampling is claimed, so Poisson sampling is refused (its amplified accounting for banded MF is not implemented),
and so is a band wider than the separation P (its sensitivity is not proven) and a step beyond the S planned.

Under FSDP2 (``train.sharding: fsdp``) each rank filters the keyed noise of the rows it owns and keeps their state
only (``noise/correlated.py``), and every rank trains its members of the same global bins
(``sharding/cyclic_ranks.py``); plain torchrun data parallelism without sharding is refused.
"""

from __future__ import annotations

import math
from abc import ABCMeta, abstractmethod
from typing import Any

import torch
from torch import nn

from dptext.accounting import StepRun, compute_epsilon
from dptext.accounting.banded_mf import Participation, toeplitz_sensitivity
from dptext.errors import UserError
from dptext.privacy.engine import PrivacyEngine
from dptext.privacy.noise.correlated import CorrelatedNoise, FilteredNoise
from dptext.privacy.noise.optimizer import NoiseSource
from dptext.privacy.noise.randomness import randomness_note
from dptext.privacy.sampling.cyclic import CyclicBinSampler
from dptext.privacy.sharding.cyclic_ranks import rank_cyclic_sampler

MECHANISM = "banded_mf"
POISSON_REFUSED = ("Banded MF noise is accounted here without amplification by sampling, for cyclic batches with a "
                   "minimum separation, and Poisson batches break that schema; use sampling='cyclic' with banded_mf, "
                   "or mechanism dp_sgd for Poisson sampling.")


class CorrelatedNoiseEngine(PrivacyEngine, metaclass=ABCMeta):
    """What every matrix-factorization engine shares: the cyclic (k, P) schema, the planned S steps, the strategy's
    sensitivity recomputed here (``_sensitivity``), the noise filter (``_noise``) and ε of one Gaussian mechanism.

    Subclasses set ``method`` and ``label`` and describe their strategy (``_strategy_fields``)."""

    method = ""
    label = ""
    poisson_refused = ""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, noise_multiplier: float,
                 max_grad_norm: float, dataset_size: int, steps: int, bins: int, sampling: str = "cyclic",
                 ledger: Any = None, distributed: Any = None, **options: Any):
        if sampling != "cyclic":
            raise UserError(self.poisson_refused)
        if distributed is not None and distributed.active and not distributed.sharded:
            raise UserError(f"The {self.label} noise runs under torchrun only with train.sharding=fsdp (each rank "
                            "keeps the noise state of the rows it owns); set it, or train in one process.")
        if isinstance(bins, bool) or not isinstance(bins, int) or not 1 <= bins <= dataset_size:
            raise UserError(f"The cyclic separation P (bins) must be a whole number from 1 to the dataset size "
                            f"({dataset_size}), got {bins!r}.")
        self.schema = Participation(math.ceil(steps / bins), bins)
        self.bins, self.planned_steps = bins, steps
        self.strategy_sensitivity = self._sensitivity()
        super().__init__(model, optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                         dataset_size=dataset_size, expected_batch_size=dataset_size / bins, ledger=ledger,
                         distributed=distributed, **options)
        self._wrap_noise()

    @abstractmethod
    def _sensitivity(self) -> float:
        """The strategy's sensitivity under the cyclic participation schema (``self.schema``)."""

    @abstractmethod
    def _noise(self, source: NoiseSource) -> FilteredNoise:
        """The mechanism's filtered noise drawing from ``source``."""

    @abstractmethod
    def _strategy_fields(self) -> dict[str, Any]:
        """The strategy's public description for ``mechanism()`` and the ledger."""

    def _wrap_noise(self) -> None:
        source = self.dp_optimizer.noise
        source = source.source if isinstance(source, FilteredNoise) else source
        self.dp_optimizer.noise = self._noise(source)

    def replan(self, verify: bool = True, make_batch=None, loss_fn=None) -> None:
        if self.steps:
            raise UserError(f"The trainable set cannot change during a {self.label} run (the noise of later steps "
                            "depends on the earlier steps' noise per parameter); re-plan before the first step.")
        super().replan(verify, make_batch, loss_fn)
        self._wrap_noise()

    def step(self, per_example_loss=None) -> None:
        if self.steps >= self.planned_steps:
            raise UserError(f"The {self.label} strategy was accounted for {self.planned_steps} steps and they are "
                            "done; a further step is not covered by its sensitivity. Plan more steps.")
        super().step(per_example_loss)

    def sampler(self, steps: int | None = None) -> CyclicBinSampler:
        """The cyclic bins this engine is accounted for, from the root's secret "sampler" child."""
        if steps is not None and steps != self.planned_steps:
            raise UserError(f"The {self.label} strategy was accounted for {self.planned_steps} steps, not {steps}.")
        if self.distributed is not None:  # FSDP2: the same global bins on every rank, each training its members
            return rank_cyclic_sampler(self.root, self.distributed, self.dataset_size, self.bins, self.planned_steps)
        return CyclicBinSampler(self.dataset_size, self.bins, self.planned_steps, self.root.generator("sampler"))

    def user_sampler(self, *args: Any, **kwargs: Any):
        raise UserError(f"User-level DP with {self.label} noise is not accounted yet; use privacy.unit=example.")

    def epsilon(self, delta: float, accountant: str = "rdp") -> float:
        """ε of the whole planned run (the strategy is fixed for all S steps) by ``accountant`` applied to the one
        Gaussian mechanism it is; 0 before the first step."""
        if not self.steps:
            return 0.0
        runs = [StepRun(1.0, self.noise_multiplier / self.strategy_sensitivity, 1)]
        result = compute_epsilon(accountant, runs, delta)
        return result.epsilon if result.approximate else result.guaranteed

    def accounting(self) -> dict[str, Any]:
        return {"mechanism": self.method, "noise_multiplier": self.noise_multiplier, "steps": self.steps,
                "planned_steps": self.planned_steps, "strategy_sensitivity": self.strategy_sensitivity,
                "sampling": "cyclic", "matches_accounting": True}

    def mechanism(self) -> dict[str, Any]:
        return {"method": self.method, "unit": "example",
                "guarantee": "example-level (ε, δ); one Gaussian mechanism with noise multiplier σ/sens(C), "
                             "no amplification by sampling",
                "sensitivity": self.max_grad_norm, "strategy_sensitivity": self.strategy_sensitivity,
                "noise_multiplier": self.noise_multiplier, **self._strategy_fields(),
                "planned_steps": self.planned_steps,
                "separation": self.schema.separation, "max_participations": self.schema.max_participations,
                "sampling": "cyclic", "participation": "balls-in-bins: min separation P, ≤ ⌈S/P⌉ steps each",
                "processes": self.distributed.world_size if self.distributed else 1,
                **({"noise_site": "each rank its own rows, from the keyed per-coordinate stream"}
                   if self.distributed else {}),
                "randomness": randomness_note(self.root), "noise_secret": self.root.secret,
                "clipping_verified": self.verified}


class BandedMFEngine(CorrelatedNoiseEngine):
    """DP training with banded MF noise: ``coefficients`` (c_0, …, c_{b−1}) of C, ``bins`` P ≥ b, ``steps`` S.

    ``noise_multiplier`` σ is the std of Z's entries over the clipping norm; ε is that of a Gaussian mechanism with
    multiplier σ / sens(C) (``strategy_sensitivity``). Strategies from ``accounting.mf_strategy.optimize_banded``
    are scaled to sensitivity 1, so σ is then the Gaussian mechanism's own multiplier."""

    method, label, poisson_refused = MECHANISM, "banded MF", POISSON_REFUSED

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, bins: int, coefficients: list[float],
                 **options: Any):
        self.coefficients = [float(c) for c in coefficients]
        if isinstance(bins, int) and not isinstance(bins, bool) and bins < len(self.coefficients):
            raise UserError(f"The cyclic separation P (bins) must be at least the number of bands "
                            f"({len(self.coefficients)}), got {bins!r}; a band wider than the separation has no "
                            "proven sensitivity here.")
        super().__init__(model, optimizer, bins=bins, **options)

    def _sensitivity(self) -> float:
        return toeplitz_sensitivity(self.coefficients, self.planned_steps, self.schema)

    def _noise(self, source: NoiseSource) -> FilteredNoise:
        return CorrelatedNoise(source, self.coefficients, self.params)

    def _strategy_fields(self) -> dict[str, Any]:
        return {"coefficients": list(self.coefficients), "bands": len(self.coefficients),
                "noise": "(C⁻¹Z)_t, Z i.i.d. N(0, σ²C²), once per coordinate per step; b − 1 buffers"}
