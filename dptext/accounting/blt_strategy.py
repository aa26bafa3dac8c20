"""Choosing a BLT strategy: the ω, θ of d buffers that minimise the error of the noisy prefix sums.

As for banded strategies (``mf_strategy``), SGD at a constant learning rate applies A·(G + C⁻¹Z), A the n×n
prefix-sum matrix, and Z's entries have variance σ²·sens(C)², so per unit of σ² the error is sens(C)²·‖A C⁻¹‖²
in one of two senses:

* ``mean``: the expected squared error averaged over the n prefix sums, sens² · Σ_t (n − t)·e_t² / n;
* ``max``: that of the worst (last) prefix sum, sens² · Σ_t e_t²,

with e = cumsum(first column of C⁻¹) the first column of the Toeplitz A C⁻¹ (its row t has squared norm
Σ_{j≤t} e_j², largest at t = n − 1). sens is the exact min-separation sensitivity of ``accounting.blt`` (the
earliest pattern π₀), valid because the search runs over ω = exp(v) > 0 and θ = sigmoid(u) in (0, 1)
(unconstrained L-BFGS in (v, u), where the decay times 1/(1 − θ) are on a log scale). c_0 = 1 during the search
(the loss does not depend on C's scale), and the result is scaled to sensitivity 1.

Gradient, exactly: with d = C⁻¹'s first column, ∂d/∂c_j = −shift_j(d ∗ d) (Toeplitz matrices commute), so
∂error/∂c_j = −2 Σ_t w_t e_t h_{t−j} with h = cumsum(d ∗ d), a correlation (FFT); ∂sens²/∂c_j = 2 Σ_{p∈π₀}
(C·1_{π₀})_{p+j}; then ∂c_j/∂ω_i = θ_i^{j−1} and ∂c_j/∂θ_i = (j − 1)·ω_i·θ_i^{j−2}. Two thousand steps and four
buffers take a few seconds, from two starting spreads of decay times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize
from scipy.signal import correlate, fftconvolve
from scipy.special import expit

from dptext.accounting.banded_mf import Participation
from dptext.accounting.blt import (BLT, blt_coefficients, blt_inverse_coefficients, blt_sensitivity, decay_powers,
                                   earliest_column_sum, earliest_pattern)
from dptext.accounting.events import check_steps
from dptext.errors import UserError

ERRORS = ("mean", "max")
MAX_BUFFERS = 16
LOGIT_MAX = 30.0  # θ = sigmoid(u) stays below 1 in float64 (a decay, never a constant)


@dataclass(frozen=True)
class BLTStrategy:
    """A BLT scaled to sensitivity 1 under ``schema`` for ``steps`` steps, and its error per unit of σ²."""

    blt: BLT
    steps: int
    schema: Participation
    error: str
    loss: float

    def to_dict(self) -> dict:
        return {"mechanism": "blt", **self.blt.to_dict(), "buffers": self.blt.buffers, "steps": self.steps,
                "max_participations": self.schema.max_participations, "separation": self.schema.separation,
                "sensitivity": 1.0, "error": self.error, "prefix_sum_error": self.loss,
                "objective": ("sens(C)^2 * sum_t (n-t) e_t^2 / n (mean over prefix sums)" if self.error == "mean"
                              else "sens(C)^2 * sum_t e_t^2 (the last, worst prefix sum)")}


def _weights(n: int, error: str) -> tuple[np.ndarray, float]:
    if error not in ERRORS:
        raise UserError(f"Unknown BLT error '{error}'; choose mean or max.")
    return (n - np.arange(n, dtype=np.float64), float(n)) if error == "mean" else (np.ones(n), 1.0)


def blt_loss(omega, theta, steps: int, schema: Participation, error: str = "mean") -> tuple[float, np.ndarray]:
    """The error above for the BLT (c_0 = 1, ``omega``, ``theta``) and its gradient in (ω…, θ…)."""
    n = check_steps(steps)
    weights, norm = _weights(n, error)
    blt = BLT(1.0, tuple(float(w) for w in omega), tuple(float(t) for t in theta))
    with np.errstate(all="ignore"):  # a trial step of the optimiser may make C⁻¹ explode: inf, then backtracked
        coeffs, inverse = blt_coefficients(blt, n), blt_inverse_coefficients(blt, n)
        e = np.cumsum(inverse)
        total = float(np.sum(weights * e * e))
        column = earliest_column_sum(coeffs, schema)
        sens2 = float(column @ column)
        h = np.cumsum(fftconvolve(inverse, inverse)[:n])
        d_error = -2.0 * correlate(weights * e, h, mode="full", method="fft")[n - 1:]  # lag j = Σ_t we_{t} h_{t−j}
        marks = np.zeros(n)
        marks[earliest_pattern(n, schema)] = 1.0
        d_sens2 = 2.0 * correlate(column, marks, mode="full", method="fft")[n - 1:]
        d_coeffs = (d_sens2 * total + sens2 * d_error) / norm  # ∂loss/∂c_j, j = 0 … n − 1
        return sens2 * total / norm, _chain_to_parameters(d_coeffs, blt, n)


def _chain_to_parameters(d_coeffs: np.ndarray, blt: BLT, n: int) -> np.ndarray:
    """∂loss/∂(ω, θ) from ∂loss/∂c_j (j ≥ 1; c_0 is held at 1)."""
    if n == 1:
        return np.zeros(2 * blt.buffers)
    powers = decay_powers(blt.theta, n - 1)  # row j − 1: θ^(j−1)
    previous = np.vstack([np.zeros((1, blt.buffers)), powers[:-1]])  # row j − 1: θ^(j−2), 0 at j = 1
    lags = np.arange(n - 1, dtype=np.float64)[:, None]  # j − 1
    grad = d_coeffs[1:]
    return np.concatenate([grad @ powers, (grad @ (lags * previous)) * np.asarray(blt.omega)])


def _starts(n: int, buffers: int) -> list[np.ndarray]:
    """Initial (log ω, logit θ): decay times 1/(1 − θ) spread geometrically from 2 to n or √n, ω sharing
    c_1 = ½ (the square-root factorisation's)."""
    starts = []
    for top in (1.0, 0.5):
        times = np.geomspace(2.0, max(2.0, n ** top), buffers)
        starts.append(np.concatenate([np.log(np.full(buffers, 0.5 / buffers)), np.log(times - 1)]))
    return starts


def _parameters(x: np.ndarray, buffers: int) -> tuple[np.ndarray, np.ndarray]:
    """ω = exp(v) > 0 and θ = sigmoid(u) in (0, 1): the lemma's conditions hold everywhere the search goes."""
    return np.exp(x[:buffers]), expit(np.clip(x[buffers:], -LOGIT_MAX, LOGIT_MAX))


def optimize_blt(steps: int, buffers: int, schema: Participation, error: str = "mean",
                 max_iterations: int = 500) -> BLTStrategy:
    """The d-buffer BLT minimising ``blt_loss`` (best of a few starts), scaled to sensitivity 1 under ``schema``."""
    n = check_steps(steps)
    if isinstance(buffers, bool) or not isinstance(buffers, int) or not 1 <= buffers <= MAX_BUFFERS:
        raise UserError(f"The number of BLT buffers must be a whole number from 1 to {MAX_BUFFERS}, "
                        f"got {buffers!r}.")
    _weights(n, error)

    def objective(x: np.ndarray) -> tuple[float, np.ndarray]:
        omega, theta = _parameters(x, buffers)
        value, grad = blt_loss(omega, theta, n, schema, error)
        if not (math.isfinite(value) and np.all(np.isfinite(grad))):  # C⁻¹ blew up: make the line search back off
            return math.inf, np.zeros_like(x)
        return value, np.concatenate([grad[:buffers] * omega, grad[buffers:] * theta * (1 - theta)])

    best_x, best = None, math.inf
    for start in _starts(n, buffers):
        result = minimize(objective, start, jac=True, method="L-BFGS-B",
                          options={"maxiter": max_iterations, "ftol": 1e-13, "gtol": 1e-10})
        for x in (result.x, start):
            value = objective(x)[0]
            if value < best:
                best_x, best = x, value
    if best_x is None:
        raise UserError("The BLT optimisation diverged; use fewer buffers.")
    omega, theta = _parameters(best_x, buffers)
    blt = BLT(1.0, tuple(float(w) for w in omega), tuple(float(t) for t in theta))
    return BLTStrategy(blt.scaled(1.0 / blt_sensitivity(blt, n, schema)), n, schema, error, best)
