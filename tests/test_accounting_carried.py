"""The (ε, δ) a finished run's model carries: an upper bound (PRV's upper end, never its estimate), and a DPKD
student's teacher share included, for every reader of a run (synth teacher, DPKD teacher, audit, `dptext account`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dptext.accounting.carried import ONE_RUN, carried_privacy, guaranteed_epsilon
from dptext.attacks.audit import proven_privacy
from dptext.distill.synth import teacher_privacy


def own_run(accountant: str = "rdp", delta: float = 1e-4) -> dict:
    """A DP-SGD run's ``privacy`` block as ``finetune`` writes it (numbers made up, shapes real)."""
    return {"private": True, "accountant": accountant, "delta": delta, "noise_multiplier": 1.1, "steps": 40,
            "sample_rate": 0.05, "dataset_size": 5000,
            "epsilon": {"rdp": {"method": "rdp", "epsilon": 1.30, "lower": None, "upper": None, "approximate": False},
                        "prv": {"method": "prv", "epsilon": 1.10, "lower": 1.05, "upper": 1.15, "approximate": False},
                        "pld": {"method": "pld", "epsilon": 1.12, "lower": None, "upper": None, "approximate": False},
                        "gdp": {"method": "gdp", "epsilon": 1.00, "lower": None, "upper": None, "approximate": True}}}


def test_the_guaranteed_epsilon_is_an_upper_bound():
    assert guaranteed_epsilon(own_run("prv")) == ("prv", 1.15)  # the upper end, not the 1.10 estimate
    assert guaranteed_epsilon(own_run("pld")) == ("pld", 1.12)
    assert guaranteed_epsilon(own_run("gdp")) == ("rdp", 1.30)  # an approximation is never the claim
    missing = own_run("prv")
    missing["epsilon"]["prv"] = {"method": "prv", "epsilon": None, "lower": None, "upper": None}  # out of range
    assert guaranteed_epsilon(missing) == ("rdp", 1.30)


def test_a_dp_sgd_run_carries_its_own_bound():
    carried = carried_privacy({"privacy": own_run("prv")})
    assert carried == {"private": True, "epsilon": 1.15, "delta": 1e-4, "accountant": "prv", "composition": ONE_RUN}


def test_a_dpkd_student_carries_its_teacher_share_too():
    teacher = {"teacher_run": "/runs/t", "private": True, "epsilon": 0.98, "delta": 5e-5, "accountant": "rdp"}
    result = {"privacy": own_run("rdp", delta=5e-5), "method": "dpkd",
              "privacy_claim": {"private": True, "epsilon": 2.0, "delta": 1e-4, "teacher": teacher,
                                "student_epsilon": 1.02, "student_delta": 5e-5}}
    carried = carried_privacy(result)
    assert carried["epsilon"] == pytest.approx(0.98 + 1.30) and carried["delta"] == pytest.approx(1e-4)
    assert carried["composition"] != ONE_RUN
    # reused as a synth teacher: the synthetic data inherits the total, not the student's own 1.30
    as_teacher = teacher_privacy(result, "/runs/dpkd")
    assert as_teacher["epsilon"] == pytest.approx(2.28) and as_teacher["delta"] == pytest.approx(1e-4)
    assert "epsilon_by_method" not in as_teacher  # the own steps' numbers are not the model's
    # audited: the proven ε the empirical lower bound is compared with is the total too
    assert proven_privacy(SimpleNamespace(result=result))["epsilon"] == pytest.approx(2.28)


def test_inherited_zero_shot_and_non_private_runs():
    inherited = {"private": True, "inherited": True, "epsilon": 2.1, "delta": 1e-4, "composition": "basic: ..."}
    assert carried_privacy({"privacy": inherited, "privacy_claim": inherited})["epsilon"] == 2.1
    zero = {"private": True, "epsilon": 0.0, "delta": 0.0, "note": "zero-shot student: no private data used"}
    assert carried_privacy({"privacy": zero, "privacy_claim": zero})["composition"].startswith("zero-shot")
    assert carried_privacy({"privacy": {"private": False}}) == {
        "private": False, "epsilon": None, "delta": None, "accountant": None, "composition": "none"}
    assert teacher_privacy({"privacy": {"private": False}}, "/runs/x")["private"] is False


def test_a_prv_teacher_hands_on_its_upper_bound():
    as_teacher = teacher_privacy({"privacy": own_run("prv")}, "/runs/t")
    assert as_teacher["epsilon"] == 1.15 and as_teacher["accountant"] == "prv"
    assert as_teacher["epsilon_by_method"]["prv"] == 1.10  # every accountant's own number stays on record
    assert proven_privacy(SimpleNamespace(result={"privacy": own_run("prv")}))["epsilon"] == 1.15
