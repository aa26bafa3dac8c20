"""Gaussian DP (Dong, Roth, Su 2019) with the central limit theorem for Poisson subsampling (Bu et al. 2020).

**This is an approximation, not a guarantee**, and every output that shows it says so:
the CLT says that S Poisson-subsampled Gaussian steps with rate q and noise σ behave like
one μ-GDP mechanism with μ = q·√(S·(e^{1/σ²} − 1)) as S grows and q shrinks; for a finite
run it can under-state ε (compare with PRV, which carries error bounds).

Per-step σ schedules compose as μ² = Σ_s q_s²·(e^{1/σ_s²} − 1). Steps with q = 1 are the
plain Gaussian mechanism, which is exactly (1/σ)-GDP, so they contribute 1/σ² and a run of
full-batch steps gives μ = √S/σ with no approximation at all.

A μ-GDP mechanism is (ε, δ)-DP exactly for δ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2).
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np
from scipy.optimize import brentq
from scipy.special import log_ndtr, ndtr

from dptext.accounting.events import StepRun, check_delta, group_runs


def gdp_mu(runs: Iterable[StepRun]) -> float:
    """μ of the composed run: exact for q = 1 steps, the Poisson CLT otherwise."""
    mu_squared = 0.0
    for q, sigma, steps in group_runs(runs):
        if q == 1.0:
            mu_squared += steps / sigma**2
        else:
            # expm1 keeps e^{1/σ²} − 1 accurate for large σ; it overflows to inf for
            # σ below ~0.04, where ε is meaningless anyway.
            with np.errstate(over="ignore"):
                mu_squared += steps * q**2 * float(np.expm1(1.0 / sigma**2))
    return math.sqrt(mu_squared)


def gdp_delta(epsilon: float, mu: float) -> float:
    """δ(ε) of a μ-GDP mechanism; the e^ε term is formed in log space so it cannot overflow."""
    if mu == 0:
        return 0.0
    with np.errstate(over="ignore"):  # huge ε with huge μ: the term is inf only where δ(ε) is ~0 anyway
        return float(ndtr(-epsilon / mu + mu / 2) - np.exp(epsilon + log_ndtr(-epsilon / mu - mu / 2)))


def gdp_epsilon_from_mu(mu: float, delta: float) -> float:
    """The smallest ε ≥ 0 with δ(ε) ≤ δ for a μ-GDP mechanism (δ(ε) decreases in ε)."""
    delta = check_delta(delta)
    if not math.isfinite(mu):
        return math.inf
    if gdp_delta(0.0, mu) <= delta:
        return 0.0
    high = max(1.0, mu * mu)
    while gdp_delta(high, mu) > delta:
        high *= 2
    return float(brentq(lambda eps: gdp_delta(eps, mu) - delta, 0.0, high, xtol=1e-12, rtol=1e-12))


def gdp_epsilon(runs: Iterable[StepRun], delta: float) -> tuple[float, float]:
    """(ε, μ) of a sequence of step runs at δ by GDP (CLT approximation for q < 1)."""
    mu = gdp_mu(runs)
    return gdp_epsilon_from_mu(mu, delta), mu
