"""Auditing maths over score arrays, independent of models (SPEC §7).

Convention everywhere: a *higher* score means "more likely a member". ``roc_curve`` returns the points
(FPR, TPR) of every distinct threshold, starting at (0, 0), exactly as scikit-learn's ``roc_curve`` with
``drop_intermediate=False``; ``roc_auc`` is the area under it (ties count one half, the Mann–Whitney U
statistic); ``tpr_at_fpr`` is the highest TPR among thresholds whose FPR is at most the target (Carlini et al.
2022, "Membership inference attacks from first principles").

``epsilon_lower_bound`` turns an attack into an empirical lower bound on ε. An (ε, δ)-DP mechanism forces
every membership test to satisfy TPR ≤ e^ε·FPR + δ and 1 − FPR ≤ e^ε·(1 − TPR) + δ (Kairouz et al. 2015),
so ε ≥ max(log((TPR − δ)/FPR), log((1 − FPR − δ)/(1 − TPR))). We replace TPR by a one-sided
Clopper–Pearson lower bound and FPR by an upper bound (each at level α/2, so both hold together with
probability ≥ 1 − α) and, so that choosing the threshold does not bias the bound upwards, choose it on one random
half of the scores and evaluate it on the other half. Each member / non-member is treated as an independent trial;
that is exact for scores from independent runs (Jagielski et al. 2020) and a heuristic over the examples of a single
run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import beta

_trapezoid = getattr(np, "trapezoid", None) or np.trapz  # numpy < 2 names it trapz


def _as_arrays(members, nonmembers) -> tuple[np.ndarray, np.ndarray]:
    members = np.asarray(members, dtype=float).ravel()
    nonmembers = np.asarray(nonmembers, dtype=float).ravel()
    if members.size == 0 or nonmembers.size == 0:
        raise ValueError("membership scores need at least one member and one non-member")
    if not (np.all(np.isfinite(members)) and np.all(np.isfinite(nonmembers))):
        raise ValueError("membership scores must be finite")
    return members, nonmembers


def roc_curve(members, nonmembers) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fpr, tpr, thresholds): predicting 'member' for score ≥ threshold, thresholds decreasing.

    The first point is (0, 0) with threshold +inf, the last (1, 1).
    """
    members, nonmembers = _as_arrays(members, nonmembers)
    scores = np.concatenate([members, nonmembers])
    labels = np.concatenate([np.ones(members.size), np.zeros(nonmembers.size)])
    order = np.argsort(-scores, kind="mergesort")
    scores, labels = scores[order], labels[order]
    last_of_value = np.r_[np.nonzero(np.diff(scores))[0], scores.size - 1]  # end of each run of tied scores
    true_pos = np.cumsum(labels)[last_of_value]
    false_pos = (last_of_value + 1) - true_pos
    tpr = np.r_[0.0, true_pos / members.size]
    fpr = np.r_[0.0, false_pos / nonmembers.size]
    return fpr, tpr, np.r_[np.inf, scores[last_of_value]]


def roc_auc(members, nonmembers) -> float:
    fpr, tpr, _ = roc_curve(members, nonmembers)
    return float(_trapezoid(tpr, fpr))


def tpr_at_fpr(fpr: np.ndarray, tpr: np.ndarray, target: float) -> float:
    """The best TPR of any threshold whose FPR does not exceed ``target``."""
    allowed = np.asarray(fpr) <= target
    return float(np.max(np.asarray(tpr)[allowed])) if allowed.any() else 0.0


def clopper_pearson(successes: np.ndarray | int, trials: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """One-sided (lower, upper) Clopper–Pearson bounds, each holding with probability ≥ 1 − alpha."""
    k = np.asarray(successes, dtype=float)
    lower = np.where(k > 0, beta.ppf(alpha, k, trials - k + 1), 0.0)
    upper = np.where(k < trials, beta.ppf(1 - alpha, k + 1, trials - k), 1.0)
    return lower, upper


def _epsilon_from_rates(tpr_low: np.ndarray, fpr_high: np.ndarray, delta: float) -> np.ndarray:
    """max of the two DP inequalities solved for ε (−inf where neither is informative)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        direct = np.where((tpr_low - delta > 0) & (fpr_high > 0), np.log((tpr_low - delta) / fpr_high), -np.inf)
        mirror = np.where((1 - fpr_high - delta > 0) & (1 - tpr_low > 0),
                          np.log((1 - fpr_high - delta) / (1 - tpr_low)), -np.inf)
    return np.maximum(direct, mirror)


def epsilon_bounds_at_thresholds(members, nonmembers, thresholds: np.ndarray, delta: float,
                                 alpha: float) -> np.ndarray:
    """The Clopper–Pearson ε lower bound of each threshold (both intervals at α/2)."""
    members, nonmembers = _as_arrays(members, nonmembers)
    thresholds = np.asarray(thresholds, dtype=float)
    true_pos = (members[None, :] >= thresholds[:, None]).sum(axis=1)
    false_pos = (nonmembers[None, :] >= thresholds[:, None]).sum(axis=1)
    tpr_low, _ = clopper_pearson(true_pos, members.size, alpha / 2)
    _, fpr_high = clopper_pearson(false_pos, nonmembers.size, alpha / 2)
    return _epsilon_from_rates(tpr_low, fpr_high, delta)


@dataclass(frozen=True)
class EpsilonLowerBound:
    epsilon: float  # 0 when the attack proves nothing
    threshold: float
    confidence: float
    delta: float
    evaluated_members: int
    evaluated_nonmembers: int


def epsilon_lower_bound(members, nonmembers, delta: float, confidence: float = 0.95,
                        seed: int = 0) -> EpsilonLowerBound:
    """An ε that the mechanism's true ε exceeds with probability ≥ ``confidence`` (see module docs).

    The threshold is chosen on a seeded random half of each score set and the bound computed on the rest.
    """
    members, nonmembers = _as_arrays(members, nonmembers)
    if members.size < 2 or nonmembers.size < 2:
        raise ValueError("an ε lower bound needs at least two members and two non-members")
    alpha = 1 - confidence
    rng = np.random.default_rng(seed)
    m, n = rng.permutation(members), rng.permutation(nonmembers)
    pick_m, eval_m = m[: m.size // 2], m[m.size // 2:]
    pick_n, eval_n = n[: n.size // 2], n[n.size // 2:]
    candidates = np.unique(np.concatenate([pick_m, pick_n]))
    chosen = epsilon_bounds_at_thresholds(pick_m, pick_n, candidates, delta, alpha)
    threshold = float(candidates[int(np.argmax(chosen))])
    value = float(epsilon_bounds_at_thresholds(eval_m, eval_n, np.array([threshold]), delta, alpha)[0])
    return EpsilonLowerBound(max(value, 0.0) if math.isfinite(value) else 0.0, threshold, confidence, delta,
                             int(eval_m.size), int(eval_n.size))


TARGET_FPRS = (0.01, 0.001)


def attack_summary(members, nonmembers, delta: float | None = None, confidence: float = 0.95,
                   max_curve_points: int = 400) -> dict:
    """AUC, TPR at FPR 1% and 0.1%, the ROC curve (thinned for storage) and, given δ, the ε lower bound."""
    members, nonmembers = _as_arrays(members, nonmembers)
    fpr, tpr, _ = roc_curve(members, nonmembers)
    summary = {"auc": float(_trapezoid(tpr, fpr)), "members": int(members.size),
               "nonmembers": int(nonmembers.size)}
    for target in TARGET_FPRS:
        summary[f"tpr_at_fpr_{target:g}"] = tpr_at_fpr(fpr, tpr, target)
    # Evenly spaced and log-spaced points: a log-FPR plot needs the low-FPR end kept.
    spaced = np.linspace(0, fpr.size - 1, min(max_curve_points // 2, fpr.size))
    logged = np.geomspace(1, fpr.size - 1, min(max_curve_points // 2, fpr.size)) if fpr.size > 1 else []
    keep = np.unique(np.r_[spaced, logged, 0, fpr.size - 1].astype(int))
    summary["roc"] = {"fpr": fpr[keep].tolist(), "tpr": tpr[keep].tolist()}
    if delta is not None and members.size >= 2 and nonmembers.size >= 2:
        bound = epsilon_lower_bound(members, nonmembers, delta, confidence)
        summary["epsilon_lower_bound"] = {"epsilon": bound.epsilon, "confidence": bound.confidence,
                                          "delta": bound.delta, "threshold": bound.threshold}
    return summary
