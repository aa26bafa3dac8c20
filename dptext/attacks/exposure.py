"""Canary exposure (Carlini et al. 2019, "The Secret Sharer"; Li et al. 2021 App. M), pure maths.

A canary's secret is one of |R| possible secrets. Ranking all of R by the model's log-perplexity of the secret
(lower = more likely), exposure = log₂|R| − log₂ rank(canary). Two estimates:

* ``sampled_exposure``: the rank among m candidates drawn uniformly from R, scaled to R
  (rank ≈ 1 + (|R| − 1) · below / m). When m ≥ |R| the caller scores all of R and the rank is exact. With
  sampling it resolves exposure only up to about log₂ m: a canary ranked above every sample gets log₂|R|.
* ``fitted_exposure``: fit a skew-normal to the candidates' log-perplexities and read the fraction of R below
  the canary from its CDF, exposure = −log₂ CDF(canary), which extrapolates past log₂ m (Carlini et al. §4.3).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats


def exposure_from_rank(rank: float, space_size: float) -> float:
    if rank < 1 or rank > space_size:
        raise ValueError(f"rank must lie in [1, |R|]; got {rank} for |R| = {space_size}")
    return math.log2(space_size) - math.log2(rank)


def sampled_rank(canary_score: float, candidate_scores, space_size: float) -> float:
    """1 + (|R| − 1) · (fraction of candidates with strictly lower log-perplexity); exact when
    candidates = R \\ {canary}."""
    candidates = np.asarray(candidate_scores, dtype=float)
    below = float(np.sum(candidates < canary_score))
    ties = float(np.sum(candidates == canary_score))
    fraction = (below + ties / 2) / candidates.size  # ties rank half above, half below
    return 1 + (space_size - 1) * fraction


def sampled_exposure(canary_score: float, candidate_scores, space_size: float) -> float:
    return exposure_from_rank(sampled_rank(canary_score, candidate_scores, space_size), space_size)


def fitted_exposure(canary_score: float, candidate_scores) -> dict:
    """−log₂ of the fitted CDF at the canary (skew-normal; normal if the skew-normal fit fails)."""
    candidates = np.asarray(candidate_scores, dtype=float)
    try:
        params = stats.skewnorm.fit(candidates)
        log_cdf = float(stats.skewnorm.logcdf(canary_score, *params))
        family = "skew-normal"
    except (ValueError, RuntimeError, FloatingPointError):
        log_cdf, family = float("nan"), "skew-normal"
    if not math.isfinite(log_cdf):  # the skew-normal tail underflows far out; the normal's logcdf does not
        mean, std = float(candidates.mean()), float(candidates.std(ddof=1))
        log_cdf = float(stats.norm.logcdf(canary_score, mean, std))
        family = "normal"
    return {"exposure": -log_cdf / math.log(2), "family": family}
