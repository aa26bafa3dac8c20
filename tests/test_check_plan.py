"""`dptext check` prints the plan a run would follow and refuses what `dptext finetune` refuses (issue 45)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dptext import config
from dptext.cli.app import main
from dptext.errors import UserError
from dptext.finetune import run_finetune

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
TINY = ["model.name=tiny-bert", "data.dataset=null", "data.max_eval_examples=8", "data.max_length=32",
        "task.labels=[negative,positive]", "train.batch_size=8", "train.epochs=1", "train.physical_batch_size=8",
        "train.eval_every=null", "train.log_every=1", "eval.batch_size=8", "eval.before_training=false",
        "eval.learning_curve=false", "eval.baseline=null", "name=own"]


def own_data(folder: Path, rows: int = 60) -> Path:
    path = folder / "own.csv"
    path.write_text("text,label\n" + "".join(f"review {i} was {'good' if i % 2 else 'bad'},"
                                             f"{'positive' if i % 2 else 'negative'}\n" for i in range(rows)))
    return path


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(args)
    captured = capsys.readouterr()
    return done.value.code, captured.out, captured.err


def check_plan(args: list[str], capsys) -> dict:
    code, out, err = run_cli(["check", *args, "--json"], capsys)
    assert code == 0, err
    return json.loads(out)["plan"]


def test_the_plan_is_the_plan_finetune_follows(tmp_path, capsys):
    overrides = [*TINY, f"data.path={own_data(tmp_path)}", "privacy.delta=1e-5"]
    plan = check_plan([str(QUICKSTART), *overrides], capsys)
    result = run_finetune(config.load_recipe(QUICKSTART, overrides), out=tmp_path / "run")
    ran = result["privacy"]
    assert (plan["dataset_size"], plan["steps"], plan["delta"]) == (ran["dataset_size"], ran["steps"], ran["delta"])
    assert plan["sample_rate"] == pytest.approx(ran["sample_rate"])
    assert plan["noise_multiplier"] == pytest.approx(ran["noise_multiplier"], rel=1e-12)
    assert plan["expected_batch_size"] == pytest.approx(8) and plan["micro_batch"] == 8


def test_the_plan_is_printed_for_people(tmp_path, capsys):
    code, out, err = run_cli(["check", str(QUICKSTART), *TINY, f"data.path={own_data(tmp_path)}"], capsys)
    assert code == 0, err
    for row in ("n (training examples)", "q = B/n", "steps", "expected batch", "micro-batch", "δ",
                "σ (noise multiplier)", "calibrated to ε = 8 by RDP"):
        assert row in out, row
    assert "valid" in err + out


def test_default_delta_at_small_n_warns(tmp_path, capsys):
    data = f"data.path={own_data(tmp_path)}"
    code, _, err = run_cli(["check", str(QUICKSTART), *TINY, data], capsys)
    assert code == 0 and "δ = 1/(2n)" in err and "is large at n = 48" in err
    code, _, err = run_cli(["check", str(QUICKSTART), *TINY, data, "privacy.delta=1e-5"], capsys)
    assert code == 0 and "is large" not in err  # a δ the user chose is theirs


def test_a_pinned_sigma_is_shown_as_pinned_and_headers_print_no_none(tmp_path, capsys):
    args = [str(QUICKSTART), *TINY, f"data.path={own_data(tmp_path)}", "privacy.target_epsilon=null",
            "privacy.noise_multiplier=1.5"]
    plan = check_plan(args, capsys)
    assert plan["noise_multiplier"] == 1.5 and "pinned" in plan["sigma_source"]
    code, out, err = run_cli(["finetune", *args, "--out", str(tmp_path / "run")], capsys)
    assert code == 0, err
    announced = next((line for line in (out + err).splitlines() if "tiny-bert on " in line), out + err)
    assert "None" not in announced and "σ pinned by privacy.noise_multiplier, ε per example" in announced


def refused_alike(args: list[str], capsys, tmp_path: Path, fragment: str) -> None:
    """check and finetune refuse with the same sentence, and finetune leaves no run directory behind."""
    code, _, err = run_cli(["check", *args], capsys)
    assert code == 2 and fragment in err, err
    code, out_run, err_run = run_cli(["finetune", *args, "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and fragment in err_run, err_run
    assert "Run directory" not in out_run + err_run and not (tmp_path / "run").exists()


def test_an_empty_recipe_is_refused(tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    refused_alike([str(empty)], capsys, tmp_path, "is empty")


def test_a_section_given_twice_is_refused_naming_both_lines(tmp_path, capsys):
    twice = tmp_path / "twice.yaml"
    twice.write_text(QUICKSTART.read_text() + "train:\n  epochs: 1\n")
    refused_alike([str(twice)], capsys, tmp_path, "gives 'train' twice")
    with pytest.raises(UserError, match=r"lines \d+ and \d+"):
        config.load_recipe(twice)


def test_a_key_given_twice_inside_a_section_is_refused(tmp_path):
    twice = tmp_path / "twice.yaml"
    twice.write_text("model:\n  name: tiny-bert\n  name: tiny-gpt2\n")
    with pytest.raises(UserError, match="gives 'name' twice"):
        config.load_recipe(twice)


def test_an_expected_batch_larger_than_n_is_refused(tmp_path, capsys):
    args = [str(QUICKSTART), *TINY, f"data.path={own_data(tmp_path)}", "train.batch_size=1000"]
    refused_alike(args, capsys, tmp_path, "exceeds the dataset size 48")


def test_a_non_private_plan_has_no_sigma(tmp_path, capsys):
    plan = check_plan([str(QUICKSTART), *TINY, f"data.path={own_data(tmp_path)}", "privacy.enabled=false"], capsys)
    assert plan["private"] is False and "noise_multiplier" not in plan and plan["steps"] == 6


@pytest.mark.parametrize("mechanism", ["banded_mf", "blt"])
def test_a_correlated_noise_plan_shows_the_sigma_the_run_draws(tmp_path, capsys, mechanism):
    """Not DP-SGD's Poisson σ: the one Gaussian mechanism's, and cyclic batches (issue 47)."""
    overrides = [*TINY, f"data.path={own_data(tmp_path)}", "privacy.delta=1e-5", f"privacy.mechanism={mechanism}",
                 "privacy.sampling=cyclic",
                 "privacy.mf_bands=2" if mechanism == "banded_mf" else "privacy.blt_buffers=2"]
    plan = check_plan([str(QUICKSTART), *overrides], capsys)
    result = run_finetune(config.load_recipe(QUICKSTART, overrides), out=tmp_path / "run")
    assert plan["noise_multiplier"] == pytest.approx(result["privacy"]["noise_multiplier"], rel=1e-12)
    assert plan["sigma_source"].startswith(mechanism) and plan["sampling"].startswith("cyclic")
    code, out, _ = run_cli(["check", str(QUICKSTART), *overrides], capsys)
    assert code == 0 and "q = B/n (cyclic batches)" in out and "Poisson" not in out
