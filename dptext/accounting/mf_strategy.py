"""Choosing a banded Toeplitz strategy: coefficients that minimise the error of the noisy prefix sums.

SGD at a constant learning rate applies the prefix sums of the noisy gradients, A·(G + C⁻¹Z) with A the n×n
lower-triangular matrix of ones, so the noise that reaches the model after step t is (A C⁻¹ Z)_t. With Z's entries
of variance σ²·sens(C)² (σ the Gaussian mechanism's multiplier, fixing ε), the expected squared error per
coordinate, averaged over the n prefix sums, is

    loss(C) = sens(C)² · ‖A C⁻¹‖_F² / n

(Choquette-Choo et al. 2023, "Multi-epoch MF", eq. (2); McKenna et al. 2024, "Scaling up the banded MF
mechanism", §3, whose banded Toeplitz parameterisation this is). DP-SGD is C = I: loss = k(n + 1)/2.

For C Toeplitz with first column c (c_0, …, c_{b−1}), C⁻¹ is Toeplitz with first column d = impulse response of
1/c(z), A C⁻¹ is Toeplitz with first column e = cumsum(d), and ‖A C⁻¹‖_F² = Σ_t (n − t) e_t². The loss is
invariant to scaling c, so c_0 = 1 and the other b − 1 coefficients are optimised by L-BFGS from the truncated
square-root factorisation (c_j = binom(2j, j)/4^j, Fichtenberger, Henzinger, Upadhyay 2023), with the exact
gradient: ∂d/∂c_j = −shift_j(d ∗ d). A few thousand steps and 64 bands take well under a second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize
from scipy.signal import lfilter

from dptext.accounting.banded_mf import (Participation, best_pattern, check_coefficients, inverse_coefficients,
                                         toeplitz_sensitivity)
from dptext.accounting.events import check_steps
from dptext.errors import UserError


@dataclass(frozen=True)
class BandedStrategy:
    """A banded Toeplitz strategy scaled to sensitivity 1 under ``schema`` for ``steps`` steps."""

    coefficients: tuple[float, ...]
    steps: int
    schema: Participation
    loss: float  # the objective above (mean squared prefix-sum error per unit of σ²)

    def to_dict(self) -> dict:
        return {"coefficients": list(self.coefficients), "steps": self.steps, "bands": len(self.coefficients),
                "max_participations": self.schema.max_participations, "separation": self.schema.separation,
                "sensitivity": 1.0, "prefix_sum_mse": self.loss,
                "objective": "sens(C)^2 * ||A C^-1||_F^2 / n, A = prefix sums (McKenna et al. 2024)"}


def sqrt_coefficients(bands: int) -> np.ndarray:
    """The first ``bands`` coefficients of the square root of the prefix-sum matrix: binom(2j, j) / 4^j."""
    coeffs = np.ones(bands)
    for j in range(1, bands):
        coeffs[j] = coeffs[j - 1] * (2 * j - 1) / (2 * j)
    return coeffs


def _column_counts(bands: int, steps: int, pattern: list[int]) -> np.ndarray:
    """How many columns of the pattern hold coefficient i (column t holds c_i only while i < n − t)."""
    return np.array([sum(1 for t in pattern if i < steps - t) for i in range(bands)], dtype=np.float64)


def prefix_sum_loss(coefficients, steps: int, schema: Participation) -> tuple[float, np.ndarray]:
    """loss(C) of the module docstring and its gradient with respect to every coefficient."""
    coeffs = check_coefficients(coefficients)
    n = check_steps(steps)
    if coeffs.size > schema.separation:
        raise UserError(f"{coeffs.size} bands exceed the minimum separation {schema.separation}; the sensitivity "
                        "is proven only for bands ≤ separation.")
    with np.errstate(all="ignore"):  # a trial step of the optimiser may make C⁻¹ explode: inf, then backtracked
        return _loss_and_gradient(coeffs, n, schema)


def _loss_and_gradient(coeffs: np.ndarray, n: int, schema: Participation) -> tuple[float, np.ndarray]:
    d = inverse_coefficients(coeffs, n)
    e = np.cumsum(d)
    weights = n - np.arange(n, dtype=np.float64)
    error = float(np.sum(weights * e * e))
    head = np.cumsum(coeffs ** 2)
    sens2, pattern = best_pattern(head[np.minimum(coeffs.size, n - np.arange(n)) - 1], schema)
    # ∂e/∂c_j = −shift_j(cumsum(d ∗ d)); ∂error/∂c_j = −2 Σ_{t≥j} w_t e_t h_{t−j}
    h = np.cumsum(lfilter([1.0], coeffs, d))
    we = weights * e
    d_error = np.array([-2.0 * np.dot(we[j:], h[:n - j]) for j in range(coeffs.size)])
    d_sens2 = 2.0 * coeffs * _column_counts(coeffs.size, n, pattern)
    return sens2 * error / n, (d_sens2 * error + sens2 * d_error) / n


def optimize_banded(steps: int, bands: int, schema: Participation, max_iterations: int = 500) -> BandedStrategy:
    """The banded Toeplitz strategy (c_0 = 1 before scaling) minimising ``prefix_sum_loss``, scaled to sens 1."""
    n = check_steps(steps)
    if isinstance(bands, bool) or not isinstance(bands, int) or not 1 <= bands <= schema.separation:
        raise UserError(f"The number of bands must be a whole number from 1 to the minimum separation "
                        f"{schema.separation}, got {bands!r}.")
    bands = min(bands, n)
    start = sqrt_coefficients(bands)

    def objective(free: np.ndarray) -> tuple[float, np.ndarray]:
        value, grad = prefix_sum_loss(np.concatenate(([1.0], free)), n, schema)
        return value, grad[1:]

    coeffs = start
    if bands > 1:
        result = minimize(objective, start[1:], jac=True, method="L-BFGS-B",
                          options={"maxiter": max_iterations, "ftol": 1e-12, "gtol": 1e-10})
        candidate = np.concatenate(([1.0], result.x))
        if prefix_sum_loss(candidate, n, schema)[0] <= prefix_sum_loss(start, n, schema)[0]:
            coeffs = candidate
    sens = toeplitz_sensitivity(coeffs, n, schema)
    loss = prefix_sum_loss(coeffs, n, schema)[0]
    if not math.isfinite(loss):
        raise UserError("The strategy optimisation diverged; use fewer bands.")
    return BandedStrategy(tuple(float(c) for c in coeffs / sens), n, schema, loss)
