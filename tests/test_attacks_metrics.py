"""Auditing maths: ROC/AUC/TPR@FPR against scikit-learn, Clopper–Pearson against the binomial tail, and the
empirical ε lower bound against the true ε of a Gaussian mechanism."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize, stats

from dptext.attacks import metrics

sklearn_metrics = pytest.importorskip("sklearn.metrics")


def _sklearn_tpr_at(members, nonmembers, target):
    labels = np.r_[np.ones(len(members)), np.zeros(len(nonmembers))]
    fpr, tpr, _ = sklearn_metrics.roc_curve(labels, np.r_[members, nonmembers], drop_intermediate=False)
    return tpr[fpr <= target].max()


@pytest.mark.parametrize("seed", range(6))
def test_roc_auc_and_tpr_at_fpr_equal_sklearn(seed):
    rng = np.random.default_rng(seed)
    members = rng.normal(0.4 * seed / 5, 1, 700 + 31 * seed)
    nonmembers = rng.normal(0, 1, 1200 - 17 * seed)
    if seed % 2:  # ties across and within the two groups
        members, nonmembers = np.round(members, 1), np.round(nonmembers, 1)
    labels = np.r_[np.ones(members.size), np.zeros(nonmembers.size)]
    scores = np.r_[members, nonmembers]
    assert metrics.roc_auc(members, nonmembers) == pytest.approx(sklearn_metrics.roc_auc_score(labels, scores),
                                                                 abs=1e-12)
    fpr, tpr, thresholds = metrics.roc_curve(members, nonmembers)
    ref_fpr, ref_tpr, ref_thresholds = sklearn_metrics.roc_curve(labels, scores, drop_intermediate=False)
    np.testing.assert_allclose(fpr, ref_fpr)
    np.testing.assert_allclose(tpr, ref_tpr)
    np.testing.assert_allclose(thresholds[1:], ref_thresholds[1:])
    for target in (0.01, 0.001, 0.1):
        assert metrics.tpr_at_fpr(fpr, tpr, target) == _sklearn_tpr_at(members, nonmembers, target)
    summary = metrics.attack_summary(members, nonmembers)
    assert summary["auc"] == pytest.approx(sklearn_metrics.roc_auc_score(labels, scores), abs=1e-12)
    assert summary["tpr_at_fpr_0.01"] == _sklearn_tpr_at(members, nonmembers, 0.01)
    assert summary["roc"]["fpr"][0] == 0 and summary["roc"]["tpr"][-1] == 1


def test_perfect_and_reversed_attacks():
    assert metrics.roc_auc([2, 3, 4], [0, 1]) == 1.0
    assert metrics.roc_auc([0, 1], [2, 3, 4]) == 0.0
    assert metrics.roc_auc([1, 1], [1, 1]) == 0.5
    with pytest.raises(ValueError):
        metrics.roc_auc([], [1.0])
    with pytest.raises(ValueError):
        metrics.roc_auc([np.nan], [1.0])


@pytest.mark.parametrize("k,n", [(0, 20), (3, 20), (20, 20), (57, 400), (1, 1000)])
def test_clopper_pearson_is_the_binomial_tail_inversion(k, n):
    alpha = 0.025
    lower, upper = metrics.clopper_pearson(k, n, alpha)
    if k > 0:  # P(X ≥ k | p = lower) = α exactly
        assert stats.binom.sf(k - 1, n, float(lower)) == pytest.approx(alpha, rel=1e-6)
    else:
        assert lower == 0
    if k < n:  # P(X ≤ k | p = upper) = α exactly
        assert stats.binom.cdf(k, n, float(upper)) == pytest.approx(alpha, rel=1e-6)
    else:
        assert upper == 1


def test_epsilon_from_rates_solves_both_dp_inequalities():
    delta = 1e-5
    eps = metrics._epsilon_from_rates(np.array([0.5, 0.999, 0.0]), np.array([0.05, 0.5, 0.0]), delta)
    assert eps[0] == pytest.approx(max(math.log((0.5 - delta) / 0.05), math.log((0.95 - delta) / 0.5)))
    assert eps[1] == pytest.approx(math.log((0.5 - delta) / 0.001))  # the mirrored form wins
    assert eps[2] <= 0  # a test that never says 'member' proves nothing


def gaussian_mechanism_epsilon(mu: float, delta: float) -> float:
    """True ε(δ) of μ-GDP (Dong et al.): δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2),
    solved for ε."""
    def delta_of(eps):
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)

    if delta_of(0.0) <= delta:
        return 0.0
    return optimize.brentq(lambda e: delta_of(e) - delta, 0.0, 100.0)


@pytest.mark.parametrize("mu", [0.5, 1.0, 2.0, 4.0])
def test_epsilon_lower_bound_never_exceeds_the_true_epsilon(mu):
    """Scores from N(μ, 1) (members) and N(0, 1) (non-members) are exactly a μ-GDP mechanism's outputs."""
    delta = 1e-5
    true_eps = gaussian_mechanism_epsilon(mu, delta)
    bounds = []
    for seed in range(40):
        rng = np.random.default_rng(1000 * seed + int(10 * mu))
        members, nonmembers = rng.normal(mu, 1, 1000), rng.normal(0, 1, 1000)
        bound = metrics.epsilon_lower_bound(members, nonmembers, delta, confidence=0.95, seed=seed)
        bounds.append(bound.epsilon)
        assert bound.evaluated_members == 500 and bound.evaluated_nonmembers == 500
    assert max(bounds) <= true_eps, (mu, true_eps, max(bounds))
    if mu >= 2:  # and the bound is informative when the mechanism leaks a lot
        assert np.median(bounds) > 1.0


def test_epsilon_lower_bound_without_the_split_would_overshoot():
    """Why the threshold is chosen on held-apart data: maximising the bound over thresholds on the same small
    sample of a weak mechanism finds spurious ε > 0 far more often than the split version."""
    delta, hits_same, hits_split = 1e-5, 0, 0
    for seed in range(60):
        rng = np.random.default_rng(seed)
        members, nonmembers = rng.normal(0, 1, 60), rng.normal(0, 1, 60)  # no leakage at all: true ε = 0
        same = metrics.epsilon_bounds_at_thresholds(members, nonmembers, np.r_[members, nonmembers], delta, 0.05)
        hits_same += bool(np.max(same) > 0)
        hits_split += metrics.epsilon_lower_bound(members, nonmembers, delta, seed=seed).epsilon > 0
    assert hits_split <= 3  # at most ~5% of experiments, as the confidence promises
    assert hits_same >= hits_split
