"""The PLD accountant (issue 21 point 6, issue 16 point 3): an upper bound that agrees with closed forms at q = 1,
lies within PRV's interval and under RDP, answers where PRV cannot (σ < 0.75), and calibrates training."""

from __future__ import annotations

import pytest

from dptext.accounting import StepRun, calibrate_noise_multiplier, compute_all, compute_epsilon
from dptext.accounting.calibrate import check_training_accountant
from dptext.accounting.gdp import gdp_epsilon_from_mu
from dptext.accounting.schedule import parse_schedule
from dptext.errors import UserError


@pytest.mark.parametrize("sigma, steps, delta", [(10.0, 100, 1e-5), (3.0, 4, 1e-6), (1.5, 1, 1e-5)])
def test_full_batch_is_the_exact_gaussian_composition_from_above(sigma, steps, delta):
    """q = 1: S Gaussian steps are one Gaussian mechanism with μ = √S/σ, whose ε is known in closed form."""
    exact = gdp_epsilon_from_mu(steps**0.5 / sigma, delta)
    pld = compute_epsilon("pld", [StepRun(1.0, sigma, steps)], delta).epsilon
    assert exact <= pld <= exact * 1.01 + 1e-3


@pytest.mark.parametrize("q, sigma, steps, delta", [
    (0.01, 1.0, 1000, 1e-5), (0.02, 1.0, 1000, 1e-5), (0.004, 0.9, 2500, 1e-6), (0.1, 2.0, 300, 1e-5),
])
def test_pld_lies_in_prv_interval_and_under_rdp(q, sigma, steps, delta):
    results = {r.method: r for r in compute_all([StepRun(q, sigma, steps)], delta)}
    pld, prv, rdp = results["pld"], results["prv"], results["rdp"]
    assert pld.guaranteed == pld.epsilon and not pld.approximate
    assert prv.lower - 1e-3 <= pld.epsilon <= prv.upper + 1e-3
    assert pld.epsilon < rdp.epsilon


def test_pld_answers_where_prv_cannot():
    """The quickstart's σ ≈ 0.71: PRV's discretisation fails, the summary must still show a tight bound."""
    runs = [StepRun(0.125, 0.7058, 16)]
    results = {r.method: r for r in compute_all(runs, 8.333e-5)}
    assert results["prv"].epsilon is None and "use the PLD bound" in results["prv"].note
    assert 5.0 < results["pld"].epsilon < results["rdp"].epsilon  # 6.68 against RDP's 8.0


def test_pld_composes_a_noise_schedule():
    schedule = parse_schedule("linear:0.5")
    runs = schedule.step_runs(1.0, 0.05, 60, 20)
    assert len({r.noise_multiplier for r in runs}) == 3
    pld = compute_epsilon("pld", runs, 1e-5).epsilon
    prv = compute_epsilon("prv", runs, 1e-5)
    assert prv.lower - 1e-3 <= pld <= prv.upper + 1e-3
    assert pld > compute_epsilon("pld", [StepRun(0.05, 1.0, 60)], 1e-5).epsilon  # decayed noise costs more


def test_pld_calibration_meets_the_target_from_the_safe_side():
    cal = calibrate_noise_multiplier(3.0, 1e-5, 0.02, 1000, "pld")
    assert cal.epsilon <= 3.0 and cal.epsilon == pytest.approx(3.0, rel=2e-3) and not cal.approximate
    rdp_sigma = calibrate_noise_multiplier(3.0, 1e-5, 0.02, 1000, "rdp").noise_multiplier
    assert cal.noise_multiplier < rdp_sigma  # the tighter bound needs less noise


def test_only_accountants_with_a_guarantee_may_calibrate_training():
    for method in ("rdp", "prv", "pld"):
        assert check_training_accountant(method) == method
    with pytest.raises(UserError, match="approximation"):
        check_training_accountant("gdp")


def test_the_finetune_summary_never_says_not_computed(capsys):
    """Issue 16: at the quickstart's σ the summary's PRV row points to the PLD bound, which it prints."""
    from dptext.cli.finetune import render_result
    from dptext.output import Output

    results = compute_all([StepRun(0.125, 0.7058, 16)], 8.333e-5)
    privacy = {"private": True, "accountant": "rdp", "epsilon": {r.method: r.to_dict() for r in results},
               "delta": 8.333e-5, "noise_multiplier": 0.7058, "max_grad_norm": 0.1, "steps": 16,
               "expected_batch_size": 750.0}
    result = {"eval_split": "validation", "metrics": {"accuracy": 75.0}, "metrics_before_training": {},
              "privacy": privacy, "seconds": 1.0, "recipe": "quickstart", "model": "m", "task": "classification",
              "primary_metric": "accuracy", "run_dir": "runs/q", "model_dir": "runs/q/model"}
    render_result(Output(quiet=False), result)
    printed = "".join(capsys.readouterr())
    assert "not computed" not in printed and "see the PLD bound" in printed and "PLD bound" in printed
