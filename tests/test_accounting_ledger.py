"""PrivacyLedger (compact runs, round trip, resume through a run directory), schedules and plans."""

from __future__ import annotations

import json
import math

import pytest

from dptext.accounting.events import StepRun, default_delta, steps_for_epochs
from dptext.accounting.ledger import PrivacyLedger
from dptext.accounting.plan import plan_for_recipe, plan_from_options
from dptext.accounting.schedule import NoiseSchedule, parse_schedule
from dptext.config import load_recipe
from dptext.errors import UserError
from dptext.runs import RunDir


def test_identical_steps_are_stored_as_one_run():
    ledger = PrivacyLedger(delta=1e-5)
    for _ in range(500):
        ledger.record_step(sample_rate=0.01, noise_multiplier=1.0)
    for _ in range(3):
        ledger.record_step(0.01, 0.9)
    ledger.record_step(0.01, 1.0)
    assert ledger.steps == 504
    assert ledger.runs == (StepRun(0.01, 1.0, 500), StepRun(0.01, 0.9, 3), StepRun(0.01, 1.0, 1))


def test_epsilon_equals_the_one_shot_account():
    ledger = PrivacyLedger(delta=1e-5)
    for _ in range(1000):
        ledger.record_step(0.01, 1.0)
    assert round(ledger.epsilon("rdp").epsilon, 3) == 2.101
    assert round(ledger.epsilon("gdp").epsilon, 3) == 1.618
    assert ledger.epsilon_spent() == ledger.epsilon("rdp").epsilon
    assert [r.method for r in ledger.report()] == ["rdp", "prv", "pld", "gdp"]


def test_default_delta_is_one_over_two_n_and_stated():
    ledger = PrivacyLedger(dataset_size=50_000)
    assert ledger.delta == 1e-5 == default_delta(50_000)
    assert "1/(2n)" in ledger.delta_source and "50000" in ledger.delta_source
    with pytest.raises(UserError, match="No δ given"):
        PrivacyLedger()
    from_plan = PrivacyLedger(1e-5, 50_000, delta_source=ledger.delta_source)  # δ computed by a PrivacyPlan
    assert PrivacyLedger.from_dict(from_plan.to_dict(with_epsilon=False)).delta_source == ledger.delta_source


def test_round_trip_through_plain_json():
    ledger = PrivacyLedger(dataset_size=1000, accountant="prv")
    ledger.record_steps(0.02, 1.1, 250)
    ledger.record_steps(0.02, 0.95, 50)
    data = json.loads(json.dumps(ledger.to_dict()))
    assert data["steps"] == 300 and data["delta"] == 5e-4 and set(data["epsilon"]) == {"rdp", "prv", "pld", "gdp"}
    restored = PrivacyLedger.from_dict(data)
    assert restored.runs == ledger.runs and restored.delta == ledger.delta
    assert restored.accountant == "prv" and restored.delta_source == ledger.delta_source
    assert restored.epsilon("rdp") == ledger.epsilon("rdp")


def test_resume_continues_the_same_account(tmp_path):
    recipe = load_recipe(None, ["name=ledger-test"])
    run = RunDir.create(recipe, out=tmp_path / "run")
    first = PrivacyLedger(delta=1e-5)
    for _ in range(300):
        first.record_step(0.01, 1.0)
    run.save_ledger(first.to_dict())

    resumed = PrivacyLedger.from_dict(RunDir.open(tmp_path / "run").load_ledger())
    for _ in range(700):
        resumed.record_step(0.01, 1.0)
    run.save_ledger(resumed.to_dict())

    uninterrupted = PrivacyLedger(delta=1e-5, runs=[StepRun(0.01, 1.0, 1000)])
    final = PrivacyLedger.from_dict(run.load_ledger())
    assert final.runs == uninterrupted.runs == (StepRun(0.01, 1.0, 1000),)
    assert final.epsilon("rdp").epsilon == uninterrupted.epsilon("rdp").epsilon


@pytest.mark.parametrize("damage", [
    lambda d: d.pop("runs"),
    lambda d: d.update(format=99),
    lambda d: d["runs"][0].update(noise_multiplier=-1),
    lambda d: d["runs"][0].pop("steps"),
    lambda d: d.update(steps=12345),
    lambda d: d.update(delta=2.0),
])
def test_damaged_ledgers_are_refused(damage):
    data = PrivacyLedger(delta=1e-5, runs=[StepRun(0.01, 1.0, 10)]).to_dict(with_epsilon=False)
    damage(data)
    with pytest.raises(UserError):
        PrivacyLedger.from_dict(data)


@pytest.mark.parametrize("q,sigma", [(0.0, 1.0), (1.2, 1.0), (0.01, 0.0), (0.01, math.inf), (0.01, math.nan)])
def test_bad_steps_are_refused(q, sigma):
    with pytest.raises(UserError):
        PrivacyLedger(delta=1e-5).record_step(q, sigma)


def test_schedules_decay_by_epoch():
    assert parse_schedule(None) == parse_schedule("constant") == NoiseSchedule()
    linear, exp, listed = parse_schedule("linear:0.5"), parse_schedule("exp:0.1"), parse_schedule("list:1,0.8,0.5")
    assert [linear.factor(t) for t in range(3)] == [1.0, 1 / 1.5, 0.5]
    assert exp.factor(3) == pytest.approx(math.exp(-0.3), rel=1e-15)
    assert [listed.factor(t) for t in range(5)] == [1, 0.8, 0.5, 0.5, 0.5]
    runs = linear.step_runs(2.0, 0.01, 250, 100)
    assert runs == (StepRun(0.01, 2.0, 100), StepRun(0.01, 2.0 / 1.5, 100), StepRun(0.01, 1.0, 50))
    assert linear.sigma_at(2.0, 199, 100) == runs[1].noise_multiplier  # what the engine uses


@pytest.mark.parametrize("text", ["cosine:1", "linear:x", "exp:-1", "list:", "list:1,0"])
def test_bad_schedules_are_user_errors(text):
    with pytest.raises(UserError):
        parse_schedule(text)


def test_plans_from_options_and_recipes():
    plan = plan_from_options(dataset_size=42061, batch_size=1024, epochs=10)
    assert plan.sample_rate == 1024 / 42061 and plan.steps == 411 and plan.delta == 1 / (2 * 42061)
    assert steps_for_epochs(3, 0.01) == 300
    with pytest.raises(UserError, match="not both"):
        plan_from_options(sample_rate=0.01, steps=10, epochs=1)
    with pytest.raises(UserError, match="--batch-size and --dataset-size"):
        plan_from_options(batch_size=10, steps=10, delta=1e-5)
    recipe = load_recipe(None, ["train.batch_size=100", "train.max_steps=77", "privacy.delta=1e-6"])
    plan = plan_for_recipe(recipe, 10_000)
    assert (plan.sample_rate, plan.steps, plan.delta, plan.delta_source) == (0.01, 77, 1e-6, "given")
