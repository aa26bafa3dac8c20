"""Buffered linear Toeplitz (BLT) strategies: their structure and sensitivity under (k, b)-participation (SPEC §12).

A BLT with d buffers (McMahan, Choquette-Choo et al. 2024, "Efficient and near-optimal noise generation for
streaming differential privacy") is the lower-triangular Toeplitz strategy C whose first column is

    c_0 = c0,   c_j = Σ_{i<d} ω_i θ_i^{j−1}   (j ≥ 1),

a sum of d geometric decays. Solving C·w = z for the noise w = C⁻¹z then needs only d running sums: with
s_{i,t} = Σ_{j≥1} θ_i^{j−1} w_{t−j},

    w_t = (z_t − Σ_i ω_i s_{i,t}) / c0,    s_{i,t+1} = θ_i s_{i,t} + w_t,    s_{i,0} = 0,

so training keeps d model-sized buffers however long the run (``privacy/noise/correlated.py``). Unlike a banded
strategy, every column of C reaches the last step, so the columns of one participation pattern overlap.

**Sensitivity** (what ``monotone_toeplitz_sensitivity`` computes, exactly). For any C with clipped rows,
sup_{‖g_t‖≤1} ‖Σ_{t∈π} C[:, t] g_tᵀ‖²_F = sup Σ_{s,t∈π} X[s,t]⟨g_s, g_t⟩ ≤ Σ_{s,t∈π} |X[s,t]| with X = CᵀC, with
equality when X ≥ 0 (take every g_t the same unit vector). Suppose every c_j ≥ 0 and c_1 ≥ c_2 ≥ … (c_0 may be
anything ≥ 0; a BLT with ω ≥ 0 and 0 ≤ θ < 1 is such a C). Then X ≥ 0, and for s ≤ t, Δ = t − s,

    X[s,t] = Σ_{m=0}^{n−1−t} c_{m+Δ} c_m

is non-increasing in t at fixed Δ (fewer non-negative terms) and, for Δ ≥ 1, in Δ at fixed t (c_{m+Δ} with
m + Δ ≥ 1); the diagonal X[t,t] is non-increasing in t. A pattern t_1 < … < t_m with gaps ≥ b has t_j ≥ (j−1)b and
|t_i − t_j| ≥ |i − j|·b, so moving it to π₀ = (0, b, …, (m−1)b) raises no term of Σ X[t_i, t_j]; adding
participations (up to min(k, ⌈n/b⌉), which is all that fit) only adds terms ≥ 0. Hence

    sens(C)² = ‖C·1_{π₀}‖²,   π₀ = {0, b, 2b, …} ∩ [0, n), |π₀| = min(k, ⌈n/b⌉),

attained by π₀ itself, so the value is exact, not only a bound (the proof above is self-contained: the code
relies on nothing else). The conditions are checked on the n coefficients actually used; a C that fails them
falls back to ``banded_mf.sensitivity`` (enumeration over every pattern, n ≤ 16) or is refused. ε then follows
as for banded MF: one Gaussian mechanism of multiplier σ/sens(C).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.signal import lfilter

from dptext.accounting.banded_mf import BRUTE_FORCE_STEPS, Participation, sensitivity, toeplitz_strategy
from dptext.accounting.events import check_steps
from dptext.errors import UserError


@dataclass(frozen=True)
class BLT:
    """C with c_0 = ``c0`` and c_j = Σ_i ``omega``[i]·``theta``[i]^(j−1) for j ≥ 1 (module docstring)."""

    c0: float
    omega: tuple[float, ...]
    theta: tuple[float, ...]

    def __post_init__(self) -> None:
        values = np.array([self.c0, *self.omega, *self.theta], dtype=np.float64)
        if (len(self.omega) != len(self.theta) or not self.omega or not np.all(np.isfinite(values))
                or self.c0 == 0):
            raise UserError("A BLT strategy needs as many finite ω as θ (at least one buffer) and c_0 ≠ 0 "
                            "(C must be invertible).")

    @property
    def buffers(self) -> int:
        return len(self.omega)

    def scaled(self, factor: float) -> BLT:
        """factor·C: c_0 and every ω scaled, the decays θ unchanged."""
        return BLT(self.c0 * factor, tuple(w * factor for w in self.omega), self.theta)

    def to_dict(self) -> dict:
        return {"c0": self.c0, "omega": list(self.omega), "theta": list(self.theta)}


def decay_powers(theta, steps: int) -> np.ndarray:
    """steps × d matrix of θ_i^(j−1) for j = 1 … steps, by repeated multiplication (rounding keeps it monotone)."""
    theta = np.asarray(theta, dtype=np.float64)
    factors = np.empty((check_steps(steps), theta.size))
    factors[0], factors[1:] = 1.0, theta
    return np.cumprod(factors, axis=0)


def blt_coefficients(blt: BLT, steps: int) -> np.ndarray:
    """The first column (c_0, …, c_{n−1}) of the n×n BLT strategy."""
    coeffs = np.empty(check_steps(steps))
    coeffs[0] = blt.c0
    coeffs[1:] = decay_powers(blt.theta, steps - 1) @ np.asarray(blt.omega, dtype=np.float64) if steps > 1 else []
    return coeffs


def rational_form(blt: BLT) -> tuple[np.ndarray, np.ndarray]:
    """(P, Q) in ascending powers of z with c(z) = P(z)/Q(z): Q = Π(1 − θ_i z) and
    P = c0·Q + z·Σ_i ω_i Π_{l≠i}(1 − θ_l z)."""
    theta, omega = np.asarray(blt.theta), np.asarray(blt.omega)
    denominator = np.poly(theta)  # Π(x − θ_i) descending in x = Π(1 − θ_i z) ascending in z
    numerator = blt.c0 * denominator
    for i, w in enumerate(omega):
        numerator[1:] += w * np.poly(np.delete(theta, i))
    return numerator, denominator


def blt_inverse_coefficients(blt: BLT, steps: int) -> np.ndarray:
    """First column of C⁻¹: the impulse response of Q(z)/P(z), O(n·d) (C⁻¹ is a d-buffer BLT too)."""
    numerator, denominator = rational_form(blt)
    impulse = np.zeros(check_steps(steps))
    impulse[0] = 1.0
    return lfilter(denominator, numerator, impulse)


def is_monotone(coefficients: np.ndarray) -> bool:
    """The lemma's condition: every c_j ≥ 0 and c_1 ≥ c_2 ≥ … (c_0 free)."""
    return bool(np.all(coefficients >= 0) and np.all(np.diff(coefficients[1:]) <= 0))


def earliest_pattern(steps: int, schema: Participation) -> np.ndarray:
    """π₀ = (0, b, 2b, …): min(k, ⌈n/b⌉) steps, the worst pattern for a monotone Toeplitz C."""
    count = min(schema.max_participations, math.ceil(check_steps(steps) / schema.separation))
    return np.arange(count) * schema.separation


def earliest_column_sum(coefficients: np.ndarray, schema: Participation) -> np.ndarray:
    """C·1_{π₀}: the columns of C at π₀ added, each column t being c shifted down by t (cut to n)."""
    n = coefficients.size
    total = np.zeros(n)
    for start in earliest_pattern(n, schema):
        total[start:] += coefficients[:n - start]
    return total


def monotone_toeplitz_sensitivity(coefficients, schema: Participation) -> float:
    """sens(C) under ``schema`` (clipping norm 1) of the n×n lower-triangular Toeplitz C with first column
    ``coefficients``: ‖C·1_{π₀}‖ when the lemma's condition holds (exact), else enumeration for n ≤ 16."""
    coeffs = np.asarray(coefficients, dtype=np.float64)
    if is_monotone(coeffs):
        return float(np.linalg.norm(earliest_column_sum(coeffs, schema)))
    if coeffs.size > BRUTE_FORCE_STEPS:
        raise UserError("The strategy's coefficients are not all non-negative and non-increasing after c_0, where "
                        "its sensitivity over many steps is not proven here; use ω ≥ 0 and 0 ≤ θ < 1.")
    return sensitivity(toeplitz_strategy(coeffs, coeffs.size), schema)


def blt_sensitivity(blt: BLT, steps: int, schema: Participation) -> float:
    """sens of the n-step BLT strategy under ``schema`` (module docstring)."""
    return monotone_toeplitz_sensitivity(blt_coefficients(blt, steps), schema)
