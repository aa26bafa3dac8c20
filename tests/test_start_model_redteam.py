"""Red team of ``dptext.finetune.start_model``: ordinary ways of naming a model dptext trained that the run must
still recognise (it carries the start model's flags and warns), and dptext's own folders it must not take for one.

Found: ``~/…`` (expanded by the loader, not by the check) and a symbolic link to RUN_DIR/model ran silently; a
DPTrainer's output_dir (kind ``trainer``) lost ``continued_from_private_model``; a run directory written before
release.json existed (resolved.yaml only) was any folder; and every ``dptext distill`` student (its
model.name is its own RUN_DIR/student_init, registered public) took its own run for a start model: a false
warning, a false ``continued_from_private_model``, and under a recipe with privacy.enabled=false a false
``non_private`` that turned the student's covered files not_covered.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dptext import config
from dptext.distill.run import run_distill
from dptext.finetune import run_finetune
from dptext.finetune.start_model import dptext_output_of, start_model_flags
from dptext.output import Output
from dptext.runs import write_manifest

from test_start_model import overrides, released


def private_run(root: Path, flags: list[str] = ()) -> Path:
    (root / "model").mkdir(parents=True)
    (root / "model" / "config.json").write_text("{}")
    write_manifest(root, "run", list(flags))
    return root


def test_a_tilde_path_is_the_run_it_names(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    run = private_run(tmp_path / "runs" / "first", ["reproducible_noise"])
    assert dptext_output_of("~/runs/first/model") == run
    assert dptext_output_of("~/runs/first/model/") == run  # a trailing slash too
    assert start_model_flags("~/runs/first/model") == ["upstream_reproducible_noise", "continued_from_private_model"]


def test_a_symbolic_link_to_a_run_model_is_that_run(tmp_path, monkeypatch):
    run = private_run(tmp_path / "runs" / "first", ["non_private"])
    (tmp_path / "shared" / "models").mkdir(parents=True)
    link = tmp_path / "shared" / "models" / "mine"
    link.symlink_to(run / "model", target_is_directory=True)
    assert dptext_output_of(link) == run and start_model_flags(link) == ["non_private"]
    monkeypatch.chdir(tmp_path / "shared")  # relative, through the link
    assert start_model_flags("models/mine") == start_model_flags("./models/mine/") == ["non_private"]


def test_a_dptrainer_output_is_a_private_start_model(tmp_path):
    out = tmp_path / "trainer_out"
    (out / "checkpoint-4").mkdir(parents=True)
    (out / "checkpoint-4" / "config.json").write_text("{}")
    write_manifest(out, "trainer", ["seeded_noise"])
    for model in (out, out / "checkpoint-4"):
        assert start_model_flags(model) == ["upstream_reproducible_noise", "continued_from_private_model"]
    write_manifest(out, "trainer", ["no_noise"])
    assert "no_noise" in start_model_flags(out / "checkpoint-4")


def test_a_run_directory_without_release_json_is_still_a_run(tmp_path):
    """Runs written before release.json existed have resolved.yaml: their model learnt the data too."""
    run = tmp_path / "old"
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")
    (run / "resolved.yaml").write_text("name: old\nprivacy:\n  enabled: true\n  target_epsilon: 8\n")
    assert dptext_output_of(run / "model") == run
    assert start_model_flags(run / "model") == ["continued_from_private_model"]
    (run / "resolved.yaml").write_text("name: old\nprivacy:\n  enabled: false\n")
    assert start_model_flags(run / "model") == ["non_private"]


def test_nothing_for_hub_names_missing_folders_and_public_folders(tmp_path):
    for name in ("tiny-bert", "org/model", str(tmp_path / "missing" / "model"), "~/no/such/folder", ""):
        assert dptext_output_of(name) is None and start_model_flags(name) == []
    run = private_run(tmp_path / "student")
    (run / "student_init").mkdir()
    (run / "student_init" / "config.json").write_text("{}")  # registered public: cut from a public model
    assert dptext_output_of(run / "student_init") is None and start_model_flags(run / "student_init") == []


@pytest.mark.integration
def test_a_distill_student_is_not_its_own_start_model(reviews, tmp_path, capsys):
    recipe = config.load_recipe(None, [
        "model.name=tiny-llama", "task.type=language_modeling", f"data.path={reviews}", "data.max_length=16",
        "data.max_eval_examples=4", "train.batch_size=8", "train.max_steps=2", "name=student",
        "privacy.target_epsilon=8", "distill.method=dp_sgd", "distill.student=tiny-llama",
        "distill.student_layers=[0]"])
    run_distill(recipe, out=tmp_path / "student", output=Output())
    flags, statuses = released(tmp_path / "student")
    assert "model.name is a model dptext trained" not in capsys.readouterr().err
    assert flags == {} and statuses["model/model.safetensors"] == "covered"


@pytest.mark.integration
def test_a_run_from_a_linked_non_private_model_is_not_covered(reviews, tmp_path, capsys):
    first = tmp_path / "first"
    run_finetune(config.load_recipe(None, overrides(reviews, "first") + ["privacy.enabled=false"]), out=first)
    link = tmp_path / "baseline-model"
    link.symlink_to(first / "model", target_is_directory=True)
    run_finetune(config.load_recipe(None, overrides(reviews, "second", str(link))), out=tmp_path / "second",
                 output=Output())
    flags, statuses = released(tmp_path / "second")
    assert "model.name is a model dptext trained" in capsys.readouterr().err
    assert "non_private" in flags and statuses["model/model.safetensors"] == "not_covered"
