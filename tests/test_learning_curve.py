"""The quickstart's pieces (issue 45): a linear learning-rate decay, the learning-curve PNG (marked not covered),
and a committed non-private baseline shown beside the run's metrics only when it is the same recipe."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from dptext import config
from dptext.cli.finetune import render_result
from dptext.errors import UserError
from dptext.finetune import loop, run_finetune
from dptext.finetune.baseline import differences, read_baseline
from dptext.finetune.curve import CURVE, curve_points
from dptext.finetune.lr_schedule import learning_rate, set_learning_rate
from dptext.output import Output
from dptext.runs import RunDir

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
TINY = ["model.name=tiny-bert", "data.dataset=null", "data.max_eval_examples=8", "data.max_length=32",
        "task.labels=[negative,positive]", "train.batch_size=8", "train.max_steps=4", "train.physical_batch_size=8",
        "train.eval_every=2", "train.log_every=1", "eval.batch_size=8", "privacy.delta=1e-5", "name=own"]


def test_linear_decay_starts_at_the_rate_and_ends_above_zero():
    rates = [learning_rate(1e-3, "linear", step, 4) for step in range(1, 5)]
    assert rates == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])
    assert learning_rate(1e-3, "constant", 3, 4) == 1e-3


def test_the_rate_is_set_on_every_parameter_group_before_the_step():
    groups = [{"lr": 1e-3}, {"lr": 1e-3}]
    training = SimpleNamespace(optimizer=SimpleNamespace(param_groups=groups), plan=SimpleNamespace(steps=4),
                               recipe=SimpleNamespace(train=SimpleNamespace(learning_rate=1e-3, lr_schedule="linear")))
    set_learning_rate(training, 4)
    assert [g["lr"] for g in groups] == pytest.approx([2.5e-4, 2.5e-4])


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    folder = tmp_path_factory.mktemp("curve")
    data = folder / "own.csv"
    data.write_text("text,label\n" + "".join(f"review {i} was {'good' if i % 2 else 'bad'},"
                                             f"{'positive' if i % 2 else 'negative'}\n" for i in range(60)))
    overrides = [*TINY, f"data.path={data}"]
    rates = []
    original = loop.train_step

    def recording(training, sampled):  # the rate each optimizer step of the real loop runs at
        rates.append(training.optimizer.param_groups[0]["lr"])
        return original(training, sampled)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "train_step", recording)
        result = run_finetune(config.load_recipe(QUICKSTART, overrides), out=folder / "run")
    return result, RunDir.open(folder / "run"), overrides, rates


def test_the_quickstart_loop_decays_its_rate_linearly(finished):
    assert finished[3] == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])  # quickstart.yaml: lr 1e-3, linear


def test_the_curve_is_written_and_listed_as_not_covered(finished):
    result, run = finished[:2]
    assert (run.path / CURVE).read_bytes().startswith(b"\x89PNG")
    manifest = json.loads((run.path / "release.json").read_text())
    statuses = {entry["path"]: entry["status"] for entry in manifest["files"]}
    assert statuses[CURVE] == "not_covered"
    points = curve_points(run, "accuracy")
    assert [step for step, _ in points["loss"]] == [1, 2, 3, 4]  # every logged step, from the diagnostics file
    assert [step for step, _ in points["metric"]] == [0, 2, 4]  # before training, periodic, final
    assert points["epsilon"][0] == (0, 0.0) and points["epsilon"][-1][1] == pytest.approx(
        result["privacy"]["epsilon"]["rdp"]["epsilon"])


def test_the_baseline_is_shown_only_for_the_same_recipe(finished, capsys):
    result = finished[0]
    shipped = read_baseline("recipes/baselines/quickstart-nonprivate.json")
    assert differences(config.load_recipe(QUICKSTART), shipped["recipe"]) == []  # the committed file is the recipe's
    assert "model.name" in result["baseline"]["differs"]  # this tiny run is not the quickstart: not shown
    capsys.readouterr()
    render_result(Output(quiet=False), result)
    shown = capsys.readouterr().out
    assert "non-private baseline (same recipe)" not in shown and "not shown" in shown, shown
    same = {**result, "baseline": {**result["baseline"], "differs": []}}
    render_result(Output(quiet=False), same)
    shown = capsys.readouterr().out
    assert "non-private baseline (same recipe)" in shown and "Non-private baseline of the same recipe" in shown


def test_a_missing_baseline_is_refused_before_the_run(finished, tmp_path):
    recipe = config.load_recipe(QUICKSTART, [*finished[2], "eval.baseline=no/such.json"])
    with pytest.raises(UserError, match="eval.baseline 'no/such.json' is not a file"):
        run_finetune(recipe, out=tmp_path / "run")
    assert not (tmp_path / "run").exists()
