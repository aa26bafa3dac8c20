"""Calibration: agreement with dp-accounting, the safe side of the root, schedules, impossible targets."""

from __future__ import annotations

import logging
import math

import pytest

from dptext.accounting.calibrate import calibrate_noise_multiplier
from dptext.accounting.epsilon import compute_epsilon
from dptext.accounting.events import StepRun
from dptext.accounting.gdp import gdp_epsilon_from_mu
from dptext.accounting.rdp import DEFAULT_ORDERS
from dptext.accounting.schedule import parse_schedule
from dptext.errors import UserError


@pytest.fixture(autouse=True)
def _quiet_absl():
    # dp-accounting logs a warning per fractional order it cannot converge at small σ.
    logging.getLogger("absl").setLevel(logging.ERROR)


def _dp_accounting_sigma(accountant_factory, q, steps, eps, delta, low, high):
    dp_event = pytest.importorskip("dp_accounting.dp_event")
    from dp_accounting import mechanism_calibration

    def event(sigma):
        return dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)

    return mechanism_calibration.calibrate_dp_mechanism(
        accountant_factory, event, eps, delta, mechanism_calibration.ExplicitBracketInterval(low, high), tol=1e-6)


@pytest.mark.parametrize("eps,delta,q,steps", [
    (3.0, 1e-5, 0.02, 1000), (8.0, 1e-6, 0.005, 5000), (1.0, 1e-5, 0.1, 100),
])
def test_rdp_sigma_matches_dp_accounting(eps, delta, q, steps):
    pytest.importorskip("dp_accounting")
    from dp_accounting.rdp import rdp_privacy_accountant

    ours = calibrate_noise_multiplier(eps, delta, q, steps, "rdp").noise_multiplier
    theirs = _dp_accounting_sigma(lambda: rdp_privacy_accountant.RdpAccountant(list(DEFAULT_ORDERS)),
                                  q, steps, eps, delta, 0.3, 20.0)
    assert ours == pytest.approx(theirs, rel=1e-3)


def test_prv_sigma_matches_dp_accounting_pld():
    pytest.importorskip("dp_accounting")
    from dp_accounting.pld import pld_privacy_accountant

    ours = calibrate_noise_multiplier(3.0, 1e-5, 0.02, 1000, "prv", prv_bound="estimate").noise_multiplier
    theirs = _dp_accounting_sigma(lambda: pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3),
                                  0.02, 1000, 3.0, 1e-5, 0.8, 1.5)
    assert ours == pytest.approx(theirs, rel=1e-3)


def test_gdp_sigma_matches_the_clt_closed_form():
    eps, delta, q, steps = 3.0, 1e-5, 0.02, 1000
    # Independently: the μ with ε(μ) = 3, then σ from μ = q·√(S·(e^{1/σ²} − 1)).
    mu = _bisect(lambda m: gdp_epsilon_from_mu(m, delta) - eps, 1e-3, 50.0)
    expected = 1 / math.sqrt(math.log1p(mu**2 / (q**2 * steps)))
    result = calibrate_noise_multiplier(eps, delta, q, steps, "gdp")
    assert result.noise_multiplier == pytest.approx(expected, rel=1e-3)
    assert result.approximate


def _bisect(f, low, high):
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if f(mid) < 0 else (low, mid)
    return (low + high) / 2


@pytest.mark.parametrize("method", ["rdp", "prv", "gdp"])
def test_calibrated_sigma_is_safe_and_within_1e_4_of_the_root(method):
    eps, delta, q, steps = 3.0, 1e-5, 0.02, 1000
    result = calibrate_noise_multiplier(eps, delta, q, steps, method)
    measured = "upper" if method == "prv" else "epsilon"

    def spent(sigma):
        return getattr(compute_epsilon(method, [StepRun(q, sigma, steps)], delta), measured)

    assert spent(result.noise_multiplier) <= eps
    assert result.epsilon == spent(result.noise_multiplier)
    assert spent(result.noise_multiplier * (1 - 2e-4)) > eps


def test_reference_sigmas_for_the_issue_example():
    sigmas = {m: calibrate_noise_multiplier(3.0, 1e-5, 0.02, 1000, m).noise_multiplier for m in ("rdp", "gdp")}
    assert sigmas["rdp"] == pytest.approx(1.2163, abs=2e-4)
    assert sigmas["gdp"] == pytest.approx(1.0978, abs=2e-4)


def test_decaying_schedule_needs_more_initial_noise():
    constant = calibrate_noise_multiplier(3.0, 1e-5, 0.02, 1000, "rdp").noise_multiplier
    schedule = parse_schedule("linear:0.1")
    decaying = calibrate_noise_multiplier(3.0, 1e-5, 0.02, 1000, "rdp", schedule=schedule)
    assert decaying.noise_multiplier > constant
    runs = schedule.step_runs(decaying.noise_multiplier, 0.02, 1000, 50)
    assert compute_epsilon("rdp", runs, 1e-5).epsilon <= 3.0


@pytest.mark.parametrize("kwargs,message", [
    ({"target_epsilon": 0.0}, "target ε must be a positive"),
    ({"target_epsilon": -1.0}, "target ε must be a positive"),
    ({"delta": 1.0}, "δ must be in (0, 1)"),
    ({"delta": 0.0}, "δ must be in (0, 1)"),
    ({"sample_rate": 0.0}, "sampling rate q must be in (0, 1]"),
    ({"sample_rate": 1.5}, "sampling rate q must be in (0, 1]"),
    ({"steps": 0}, "steps must be a whole number"),
    ({"target_epsilon": 1e-4}, "No noise multiplier up to"),
    ({"target_epsilon": 1e6, "steps": 1, "sample_rate": 1e-6}, "no meaningful privacy"),
    ({"method": "moments"}, "Unknown accounting method"),
])
def test_impossible_targets_are_one_sentence_user_errors(kwargs, message):
    args = {"target_epsilon": 3.0, "delta": 1e-5, "sample_rate": 0.02, "steps": 1000, "method": "rdp", **kwargs}
    with pytest.raises(UserError) as info:
        calibrate_noise_multiplier(**args)
    text = str(info.value)
    assert message in text and text.count(". ") == 0 and "\n" not in text
