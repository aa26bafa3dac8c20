"""``BandedMFEngine``: the privacy engine with banded matrix-factorization noise (SPEC §12).

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
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from dptext.accounting import StepRun, compute_epsilon
from dptext.accounting.banded_mf import Participation, toeplitz_sensitivity
from dptext.errors import UserError
from dptext.privacy.engine import PrivacyEngine
from dptext.privacy.noise.correlated import CorrelatedNoise
from dptext.privacy.noise.randomness import randomness_note
from dptext.privacy.sampling.cyclic import CyclicBinSampler

MECHANISM = "banded_mf"
POISSON_REFUSED = ("Banded MF noise is accounted here without amplification by sampling, for cyclic batches with a "
                   "minimum separation, and Poisson batches break that schema; use sampling='cyclic' with banded_mf, "
                   "or mechanism dp_sgd for Poisson sampling.")


class BandedMFEngine(PrivacyEngine):
    """DP training with banded MF noise: ``coefficients`` (c_0, …, c_{b−1}) of C, ``bins`` P ≥ b, ``steps`` S.

    ``noise_multiplier`` σ is the std of Z's entries over the clipping norm; ε is that of a Gaussian mechanism with
    multiplier σ / sens(C) (``strategy_sensitivity``). Strategies from ``accounting.mf_strategy.optimize_banded``
    are scaled to sensitivity 1, so σ is then the Gaussian mechanism's own multiplier."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, noise_multiplier: float,
                 max_grad_norm: float, dataset_size: int, steps: int, bins: int, coefficients: list[float],
                 sampling: str = "cyclic", ledger: Any = None, distributed: Any = None, **options: Any):
        if sampling != "cyclic":
            raise UserError(POISSON_REFUSED)
        if distributed is not None and distributed.active:
            raise UserError("Banded MF noise runs in one process for now (its ring buffers are not sharded); "
                            "train it without torchrun, or use mechanism dp_sgd.")
        coefficients = [float(c) for c in coefficients]
        if isinstance(bins, bool) or not isinstance(bins, int) or not len(coefficients) <= bins <= dataset_size:
            raise UserError(f"The cyclic separation P (bins) must be a whole number from the number of bands "
                            f"({len(coefficients)}) to the dataset size ({dataset_size}), got {bins!r}; a band "
                            "wider than the separation has no proven sensitivity here.")
        self.schema = Participation(math.ceil(steps / bins), bins)
        self.strategy_sensitivity = toeplitz_sensitivity(coefficients, steps, self.schema)
        self.coefficients, self.bins, self.planned_steps = coefficients, bins, steps
        super().__init__(model, optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                         dataset_size=dataset_size, expected_batch_size=dataset_size / bins, ledger=ledger,
                         **options)
        self._wrap_noise()

    def _wrap_noise(self) -> None:
        source = self.dp_optimizer.noise
        source = source.source if isinstance(source, CorrelatedNoise) else source
        self.dp_optimizer.noise = CorrelatedNoise(source, self.coefficients, self.params)

    def replan(self, verify: bool = True, make_batch=None, loss_fn=None) -> None:
        if self.steps:
            raise UserError("The trainable set cannot change during a banded MF run (the noise of later steps "
                            "depends on the earlier steps' noise per parameter); re-plan before the first step.")
        super().replan(verify, make_batch, loss_fn)
        self._wrap_noise()

    def step(self, per_example_loss=None) -> None:
        if self.steps >= self.planned_steps:
            raise UserError(f"The banded MF strategy was accounted for {self.planned_steps} steps and they are "
                            "done; a further step is not covered by its sensitivity. Plan more steps.")
        super().step(per_example_loss)

    def sampler(self, steps: int | None = None) -> CyclicBinSampler:
        """The cyclic bins this engine is accounted for, from the root's secret "sampler" child."""
        if steps is not None and steps != self.planned_steps:
            raise UserError(f"The banded MF strategy was accounted for {self.planned_steps} steps, not {steps}.")
        return CyclicBinSampler(self.dataset_size, self.bins, self.planned_steps, self.root.generator("sampler"))

    def user_sampler(self, *args: Any, **kwargs: Any):
        raise UserError("User-level DP with banded MF noise is not accounted yet; use privacy.unit=example.")

    def epsilon(self, delta: float, accountant: str = "rdp") -> float:
        """ε of the whole planned run (the strategy is fixed for all S steps) by ``accountant`` applied to the one
        Gaussian mechanism it is; 0 before the first step."""
        if not self.steps:
            return 0.0
        runs = [StepRun(1.0, self.noise_multiplier / self.strategy_sensitivity, 1)]
        result = compute_epsilon(accountant, runs, delta)
        return result.epsilon if result.approximate else result.guaranteed

    def accounting(self) -> dict[str, Any]:
        return {"mechanism": MECHANISM, "noise_multiplier": self.noise_multiplier, "steps": self.steps,
                "planned_steps": self.planned_steps, "strategy_sensitivity": self.strategy_sensitivity,
                "sampling": "cyclic", "matches_accounting": True}

    def mechanism(self) -> dict[str, Any]:
        return {"method": MECHANISM, "unit": "example",
                "guarantee": "example-level (ε, δ); one Gaussian mechanism with noise multiplier σ/sens(C), "
                             "no amplification by sampling",
                "sensitivity": self.max_grad_norm, "strategy_sensitivity": self.strategy_sensitivity,
                "noise_multiplier": self.noise_multiplier, "coefficients": list(self.coefficients),
                "bands": len(self.coefficients), "planned_steps": self.planned_steps,
                "separation": self.schema.separation, "max_participations": self.schema.max_participations,
                "noise": "(C⁻¹Z)_t, Z i.i.d. N(0, σ²C²), once per coordinate per step; b − 1 buffers",
                "sampling": "cyclic balls-in-bins (min separation P, at most ⌈S/P⌉ participations)",
                "processes": 1, "randomness": randomness_note(self.root), "noise_secret": self.root.secret,
                "clipping_verified": self.verified}
