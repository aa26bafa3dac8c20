"""Accounting for banded matrix-factorization (MF) mechanisms: strategy, sensitivity, ε (SPEC §12).

Training with correlated noise releases, for the n×d matrix G of clipped gradient sums (one row per step),
C·G + Z with Z's entries i.i.d. N(0, σ²·C_clip²) and C a lower-triangular *strategy* matrix; the model only ever
sees C⁻¹(C·G + Z) = G + C⁻¹Z (post-processing). Lower-triangular C keeps this private on adaptive streams, where
each row of G depends on earlier outputs (Denisov, McMahan, Rush, Smith, Thakurta 2022, Thm 2.1).

**Participation schema.** Each unit takes part in at most ``k`` steps, any two of them at least ``separation``
steps apart ((k, b)-participation, Choquette-Choo, McMahan, Rush, Thakurta 2023, "Multi-epoch matrix
factorization mechanisms", §2). Adding or removing one unit changes the rows of G in its pattern π by vectors of
norm ≤ C_clip, so the release moves by Σ_{t∈π} C[:, t]·g_t, and

    sens(C) = max_π  sup_{‖g_t‖≤1} ‖Σ_{t∈π} C[:, t] g_tᵀ‖_F.

**Banded C.** If C is b-banded (C[i, j] = 0 unless 0 ≤ i − j < b) and the separation is ≥ b, columns of one
pattern have disjoint supports, so the sum's squared norm is Σ_{t∈π} ‖C[:, t]‖²·‖g_t‖² and the supremum is exact:
sens(C)² = max_π Σ_{t∈π} ‖C[:, t]‖² (Choquette-Choo et al. 2023, "Amplified banded matrix factorization", Thm 2;
McKenna et al. 2024, "Scaling up the banded MF mechanism", §2). The maximum over patterns is a dynamic programme
over steps (``best_pattern``), not an enumeration. Otherwise (band wider than the separation) the columns
interact; ``sensitivity`` then bounds ‖Σ C[:, t] g_t‖² ≤ Σ_{s,t∈π} |⟨C[:, s], C[:, t]⟩| over every pattern by
enumeration (small n only, exact when CᵀC ≥ 0) and refuses larger problems.

**ε.** The whole run is one Gaussian mechanism with noise multiplier σ / sens(C). We convert it with the analytic
Gaussian mechanism (Balle & Wang 2018, Thm 8), which is exact: δ(ε) = Φ(½μ − ε/μ) − e^ε Φ(−½μ − ε/μ) with
μ = sens/σ. No amplification by sampling is claimed: the bound holds for every participation pattern the sampler
may produce, whatever its randomness.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq
from scipy.signal import lfilter
from scipy.special import log_ndtr

from dptext.accounting.events import check_delta, check_epsilon, check_noise_multiplier, check_steps
from dptext.errors import UserError

BRUTE_FORCE_STEPS = 16  # patterns enumerated for a band wider than the separation: 2^16 subsets at most


@dataclass(frozen=True)
class Participation:
    """(k, b)-participation: at most ``max_participations`` steps per unit, any two ≥ ``separation`` apart."""

    max_participations: int
    separation: int

    def __post_init__(self) -> None:
        for name in ("max_participations", "separation"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"The participation schema's {name} must be a whole number ≥ 1, got {value!r}.")


def check_coefficients(coefficients) -> np.ndarray:
    """The first column (c_0, …, c_{b−1}) of a banded Toeplitz strategy; c_0 ≠ 0 keeps C invertible."""
    coeffs = np.asarray(coefficients, dtype=np.float64).reshape(-1)
    if coeffs.size == 0 or not np.all(np.isfinite(coeffs)) or coeffs[0] == 0:
        raise UserError("A banded strategy needs finite coefficients with c_0 ≠ 0 (C must be invertible).")
    return coeffs


def toeplitz_strategy(coefficients, steps: int) -> np.ndarray:
    """The n×n lower-triangular banded Toeplitz matrix with first column ``coefficients`` (cut to n)."""
    coeffs = check_coefficients(coefficients)[:check_steps(steps)]
    strategy = np.zeros((steps, steps))
    for lag, value in enumerate(coeffs):
        strategy += np.diag(np.full(steps - lag, value), -lag)
    return strategy


def inverse_coefficients(coefficients, steps: int) -> np.ndarray:
    """First column of C⁻¹ (lower-triangular Toeplitz too): the impulse response of 1/c(z), by recursion."""
    impulse = np.zeros(check_steps(steps))
    impulse[0] = 1.0
    return lfilter([1.0], check_coefficients(coefficients), impulse)


def band_of(strategy: np.ndarray) -> int:
    """The smallest b with C[i, j] = 0 unless 0 ≤ i − j < b; refuses a C that is not lower-triangular."""
    strategy = np.asarray(strategy, dtype=np.float64)
    rows, cols = np.nonzero(strategy)
    if strategy.ndim != 2 or strategy.shape[0] != strategy.shape[1]:
        raise UserError("A strategy matrix must be square (one row and one column per step).")
    if np.any(rows < cols):
        raise UserError("The strategy matrix must be lower-triangular, or step t's noise would depend on later "
                        "draws; use a lower-triangular C.")
    return int((rows - cols).max()) + 1 if rows.size else 1


def best_pattern(weights, schema: Participation) -> tuple[float, list[int]]:
    """max over allowed patterns π of Σ_{t∈π} w_t (w ≥ 0), and one maximising π: a dynamic programme.

    best[j][t] = the best total with ≤ j participations among steps ≥ t; step t joins with the best of steps ≥
    t + separation."""
    weights = np.asarray(weights, dtype=np.float64)
    steps, k, sep = weights.size, schema.max_participations, schema.separation
    best = np.zeros((k + 1, steps + sep + 1))
    take = np.zeros((k + 1, steps), dtype=bool)
    for j in range(1, k + 1):
        for t in range(steps - 1, -1, -1):
            joined = weights[t] + best[j - 1][t + sep]
            take[j][t] = joined > best[j][t + 1]
            best[j][t] = joined if take[j][t] else best[j][t + 1]
    pattern, j, t = [], k, 0
    while j > 0 and t < steps:
        if take[j][t]:
            pattern.append(t)
            j, t = j - 1, t + sep
        else:
            t += 1
    return float(best[k][0]), pattern


def allowed_patterns(steps: int, schema: Participation):
    """Every non-empty pattern the schema allows on ``steps`` steps (for brute force on small n)."""
    for size in range(1, min(schema.max_participations, steps) + 1):
        for pattern in itertools.combinations(range(steps), size):
            if all(b - a >= schema.separation for a, b in zip(pattern, pattern[1:])):
                yield pattern


def sensitivity(strategy: np.ndarray, schema: Participation) -> float:
    """sens(C) under ``schema`` for a clipping norm of 1 (module docstring): exact for a band ≤ separation."""
    strategy = np.asarray(strategy, dtype=np.float64)
    if band_of(strategy) <= schema.separation:
        return math.sqrt(best_pattern((strategy ** 2).sum(axis=0), schema)[0])
    steps = strategy.shape[0]
    if steps > BRUTE_FORCE_STEPS:
        raise UserError(f"The strategy's band ({band_of(strategy)}) is wider than the minimum separation "
                        f"({schema.separation}), where the sensitivity is not proven here; raise the separation to "
                        "the band or use fewer bands.")
    gram = np.abs(strategy.T @ strategy)
    return math.sqrt(max(gram[np.ix_(p, p)].sum() for p in allowed_patterns(steps, schema)))


def toeplitz_sensitivity(coefficients, steps: int, schema: Participation) -> float:
    """sens of the banded Toeplitz C without forming it: column t's squared norm is Σ_{i < min(b, n−t)} c_i²."""
    coeffs = check_coefficients(coefficients)
    if coeffs.size > schema.separation:
        return sensitivity(toeplitz_strategy(coeffs, steps), schema)  # the enumeration (or its refusal)
    head = np.cumsum(coeffs ** 2)
    column = head[np.minimum(coeffs.size, steps - np.arange(check_steps(steps))) - 1]
    return math.sqrt(best_pattern(column, schema)[0])


def gaussian_log_delta(epsilon: float, sigma: float) -> float:
    """log δ(ε) of the Gaussian mechanism with sensitivity 1 and noise std σ (Balle & Wang 2018, Thm 8)."""
    mu = 1.0 / sigma
    first = log_ndtr(mu / 2 - epsilon / mu)
    second = epsilon + log_ndtr(-mu / 2 - epsilon / mu)
    if second >= first:  # δ underflows to 0 (or rounding): the profile is below every positive δ
        return -math.inf
    return first + math.log1p(-math.exp(second - first))


def gaussian_epsilon(sigma: float, delta: float) -> float:
    """The exact ε at ``delta`` of one Gaussian mechanism with noise multiplier σ (noise std / sensitivity)."""
    sigma, delta = check_noise_multiplier(sigma), check_delta(delta)
    target = math.log(delta)
    if gaussian_log_delta(0.0, sigma) <= target:
        return 0.0
    upper = 1.0
    while gaussian_log_delta(upper, sigma) > target:
        upper *= 2
    return brentq(lambda eps: gaussian_log_delta(eps, sigma) - target, 0.0, upper, xtol=1e-12, rtol=1e-12)


def gaussian_sigma_for(epsilon: float, delta: float) -> float:
    """The smallest noise multiplier whose Gaussian mechanism is (ε, δ)-DP (ε is decreasing in σ)."""
    epsilon, delta = check_epsilon(epsilon), check_delta(delta)
    target = math.log(delta)
    low, high = 1e-3, 1.0
    while gaussian_log_delta(epsilon, high) > target:
        high *= 2
    # a little above the root, so that the calibrated σ never spends more than the target
    return brentq(lambda s: gaussian_log_delta(epsilon, s) - target, low, high, xtol=1e-12, rtol=1e-10) * (1 + 1e-9)


def mf_epsilon(noise_multiplier: float, sens: float, delta: float) -> float:
    """ε of a matrix-factorization run: Z's noise multiplier σ against the strategy's sensitivity ``sens``."""
    if not sens > 0:
        raise UserError(f"The strategy's sensitivity must be positive, got {sens!r}.")
    return gaussian_epsilon(check_noise_multiplier(noise_multiplier) / sens, delta)
