"""GDP (CLT) and PRV: closed-form Gaussian composition, dp-accounting's PLD, heterogeneous noise."""

from __future__ import annotations

import math

import pytest
from scipy import optimize, stats

from dptext.accounting import gdp, prv
from dptext.accounting.epsilon import compute_all, compute_epsilon
from dptext.accounting.events import StepRun


def exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """ε of a μ-GDP (= Gaussian, sensitivity 1, σ = 1/μ) mechanism from its closed-form δ(ε).

    Written independently of gdp.py: scipy.stats in plain floats, solved by brentq.
    """
    def delta_of(eps: float) -> float:
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)

    return optimize.brentq(lambda eps: delta_of(eps) - delta, 0.0, 200.0, xtol=1e-12)


@pytest.mark.parametrize("sigma,steps", [(1.0, 1), (2.0, 100), (10.0, 1000), (0.7, 3)])
def test_gdp_full_batch_is_exact(sigma, steps):
    eps, mu = gdp.gdp_epsilon([StepRun(1.0, sigma, steps)], 1e-5)
    assert mu == pytest.approx(math.sqrt(steps) / sigma, rel=1e-15)
    assert eps == pytest.approx(exact_gaussian_epsilon(mu, 1e-5), rel=1e-9)


def test_gdp_clt_mu_and_reference_value():
    eps, mu = gdp.gdp_epsilon([StepRun(0.01, 1.0, 1000)], 1e-5)
    assert mu == pytest.approx(0.01 * math.sqrt(1000 * math.expm1(1.0)), rel=1e-14)
    assert round(eps, 3) == 1.618


def test_gdp_schedule_adds_mu_squared():
    runs = [StepRun(0.01, 1.0, 600), StepRun(0.02, 2.0, 400)]
    expected = math.sqrt(600 * 0.01**2 * math.expm1(1.0) + 400 * 0.02**2 * math.expm1(0.25))
    assert gdp.gdp_mu(runs) == pytest.approx(expected, rel=1e-14)


def test_gdp_is_labelled_an_approximation():
    result = compute_epsilon("gdp", [StepRun(0.01, 1.0, 100)], 1e-5)
    assert result.approximate and result.guaranteed is None and "approximation" in result.note


@pytest.mark.parametrize("sigma,steps", [(10.0, 1000), (2.0, 50), (1.0, 4)])
def test_prv_interval_contains_exact_gaussian_composition(sigma, steps):
    bounds = prv.prv_epsilon([StepRun(1.0, sigma, steps)], 1e-5)
    exact = exact_gaussian_epsilon(math.sqrt(steps) / sigma, 1e-5)
    assert bounds.lower <= exact <= bounds.upper
    assert bounds.estimate == pytest.approx(exact, abs=0.01)


def test_prv_reference_value_with_bounds():
    bounds = prv.prv_epsilon([StepRun(0.01, 1.0, 1000)], 1e-5)
    assert round(bounds.estimate, 3) == 1.828
    assert bounds.lower < 1.828 < bounds.upper
    assert bounds.upper - bounds.lower == pytest.approx(2 * prv.DEFAULT_EPS_ERROR, abs=1e-3)


def _pld_epsilon(levels, delta):
    dp_event = pytest.importorskip("dp_accounting.dp_event")
    from dp_accounting.pld import pld_privacy_accountant

    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
    for q, sigma, steps in levels:
        accountant.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("q,sigma,steps,delta", [
    (0.01, 1.0, 1000, 1e-5), (0.05, 2.0, 300, 1e-5), (0.002, 0.8, 2000, 1e-6), (0.2, 3.0, 40, 1e-3),
])
def test_prv_estimate_within_its_bounds_of_dp_accounting_pld(q, sigma, steps, delta):
    ours = prv.prv_epsilon([StepRun(q, sigma, steps)], delta)
    reference = _pld_epsilon([(q, sigma, steps)], delta)
    assert ours.lower <= reference <= ours.upper
    assert ours.estimate == pytest.approx(reference, abs=0.01)


def test_prv_heterogeneous_noise_matches_pld():
    runs = [StepRun(0.01, 1.2, 300), StepRun(0.01, 0.9, 300), StepRun(0.02, 1.5, 200)]
    ours = prv.prv_epsilon(runs, 1e-5)
    reference = _pld_epsilon([(r.sample_rate, r.noise_multiplier, r.steps) for r in runs], 1e-5)
    assert ours.lower <= reference <= ours.upper


def test_merging_many_noise_levels_is_conservative(monkeypatch):
    runs = [StepRun(0.01, 1.0 + 0.01 * i, 20) for i in range(24)]
    levels, index = prv.merge_noise_levels([(r.sample_rate, r.noise_multiplier, r.steps) for r in runs], limit=4)
    assert len(levels) == 4 and sum(n for _, _, n in levels) == 480
    for run in runs:  # every original level is accounted at a level that dominates it
        q, sigma, _ = levels[index[(run.sample_rate, run.noise_multiplier)]]
        assert q >= run.sample_rate and sigma <= run.noise_multiplier
    unmerged = prv.prv_epsilon(runs, 1e-5)
    monkeypatch.setattr(prv, "MAX_NOISE_LEVELS", 4)
    merged = prv.prv_epsilon(runs, 1e-5)
    assert unmerged.merged_noise_levels == 0 and merged.merged_noise_levels == 24
    assert merged.estimate > unmerged.estimate and merged.upper > unmerged.upper


def test_prv_prefix_counts_follow_the_runs():
    runs = [StepRun(0.01, 1.0, 100), StepRun(0.01, 0.8, 50), StepRun(0.01, 1.0, 30)]
    curve = prv.PrvCurve(runs, 1e-5)
    assert curve.counts_after(120) == [100, 20]
    assert curve.counts_after(180) == [130, 50]
    assert curve.epsilon(curve.counts_after(180)) == curve.epsilon()
    # A prefix that has not reached the second noise level yet (a zero count) is the
    # account of the first level alone, up to the discretisation error.
    prefix = curve.epsilon(curve.counts_after(60))
    alone = prv.prv_epsilon([StepRun(0.01, 1.0, 60)], 1e-5)
    assert curve.counts_after(60) == [60, 0]
    assert prefix.estimate == pytest.approx(alone.estimate, abs=prv.DEFAULT_EPS_ERROR)


def test_prv_refuses_meaningless_epsilon_and_reports_it():
    result = compute_epsilon("prv", [StepRun(0.5, 0.3, 1000)], 1e-5)
    assert result.epsilon is None and "use the PLD bound" in result.note


def test_prv_is_monotone_in_steps_rate_and_noise():
    def estimate(q, sigma, steps):
        return prv.prv_epsilon([StepRun(q, sigma, steps)], 1e-5).estimate

    assert estimate(0.01, 1.0, 100) < estimate(0.01, 1.0, 400) < estimate(0.01, 1.0, 1000)
    assert estimate(0.005, 1.0, 500) < estimate(0.01, 1.0, 500) < estimate(0.02, 1.0, 500)
    assert estimate(0.01, 0.8, 500) > estimate(0.01, 1.0, 500) > estimate(0.01, 2.0, 500)


def test_all_methods_report_in_order_and_rdp_bounds_prv():
    results = compute_all([StepRun(0.01, 1.0, 1000)], 1e-5)
    assert [r.method for r in results] == ["rdp", "prv", "pld", "gdp"]
    rdp_result, prv_result, _, _ = results
    assert prv_result.upper < rdp_result.epsilon  # PRV is tighter than RDP here
    assert rdp_result.guaranteed == rdp_result.epsilon and prv_result.guaranteed == prv_result.upper


def test_prv_reports_not_computed_where_the_package_cannot_discretise():
    # prv-accountant 0.2.0 raises "Discrete mean differs from continuous mean significantly" for small σ;
    # a training run must still finish and report RDP and GDP (found by a real fine-tuning run).
    from dptext.accounting import StepRun, compute_all

    results = {r.method: r for r in compute_all([StepRun(0.125, 0.7257, 24)], 2.5e-4)}
    assert results["prv"].epsilon is None and "use the PLD bound" in results["prv"].note
    assert results["rdp"].epsilon is not None and results["gdp"].epsilon is not None
