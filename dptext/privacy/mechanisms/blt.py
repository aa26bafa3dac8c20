"""``BLTEngine``: the privacy engine with buffered-linear-Toeplitz (BLT) correlated noise (SPEC §12).

The same engine as banded MF (``banded_mf.CorrelatedNoiseEngine``): exact per-example clipping and its checks,
cyclic balls-in-bins batches (every example in at most k = ⌈S/P⌉ steps, P apart), S planned steps, ε of one
Gaussian mechanism with noise multiplier σ / sens(C). What differs is the strategy: a BLT C with c_0 and d
buffers (ω_i, θ_i) (``accounting/blt.py``), whose noise C⁻¹z is generated with d model-sized buffers per
parameter (``noise/correlated.BufferedNoise``) however many steps the run has. Its columns overlap (C is not
banded), so its sensitivity is the exact min-separation value proven for Toeplitz strategies with non-negative,
non-increasing coefficients, recomputed here from (c_0, ω, θ) for the sampler's schema, never taken from the
caller; strategies outside that class are refused beyond 16 steps (``monotone_toeplitz_sensitivity``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dptext.accounting.blt import BLT, blt_sensitivity
from dptext.privacy.mechanisms.banded_mf import CorrelatedNoiseEngine
from dptext.privacy.noise.correlated import BufferedNoise, FilteredNoise
from dptext.privacy.noise.optimizer import NoiseSource

MECHANISM = "blt"
POISSON_REFUSED = ("BLT noise is accounted here without amplification by sampling, for cyclic batches with a minimum "
                   "separation, and Poisson batches break that schema; use sampling='cyclic' with blt, or "
                   "mechanism dp_sgd for Poisson sampling.")


class BLTEngine(CorrelatedNoiseEngine):
    """DP training with BLT noise: ``blt`` (c_0, ω, θ) of C, ``bins`` P, ``steps`` S (see ``BandedMFEngine``).

    Strategies from ``accounting.blt_strategy.optimize_blt`` are scaled to sensitivity 1, so ``noise_multiplier``
    σ is then the Gaussian mechanism's own multiplier."""

    method, label, poisson_refused = MECHANISM, "BLT", POISSON_REFUSED

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, blt: BLT, **options: Any):
        self.blt = BLT(float(blt.c0), tuple(float(w) for w in blt.omega), tuple(float(t) for t in blt.theta))
        super().__init__(model, optimizer, **options)

    def _sensitivity(self) -> float:
        return blt_sensitivity(self.blt, self.planned_steps, self.schema)

    def _noise(self, source: NoiseSource) -> FilteredNoise:
        return BufferedNoise(source, self.blt.c0, list(self.blt.omega), list(self.blt.theta), self.params)

    def _strategy_fields(self) -> dict[str, Any]:
        return {**self.blt.to_dict(), "buffers": self.blt.buffers,
                "noise": "(C⁻¹Z)_t, Z i.i.d. N(0, σ²C²), once per coordinate per step; d decaying buffers"}
