"""Red team of ``model/dptext_origin.json`` (``dptext.release.ORIGIN``): a copy of a run's ``model/`` made outside
its run must not start a new output with a silently wrong privacy claim.

Found: a copied model folder was a public ``distill.student`` (its weights, learnt from the private data, went into
the student's ``student_init/``, registered public, and the student's claim left them out); a run cut off between
saving ``model/`` and ``result.json`` (a failed curve, a stray file ``write_manifest`` refuses, Ctrl-C) left a
``model/`` without its marker, so a copy of it was any folder; and a marker was ignored wherever the copy lay
within two folders of another dptext output's release.json (a DPTrainer's ``output_dir='.'``), whose flags replaced
the copy's own (a non-private copy lost ``non_private``); and the start model's flags were looked up only when the
run ended, so a start folder removed while the run trained (a copy on scratch space) left a silently clean claim.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dptext import config
from dptext.distill.run import check_public_student, run_distill
from dptext.errors import UserError
from dptext.finetune import run_finetune
from dptext.finetune.start_model import start_model_flags
from dptext.runs import write_manifest

from test_start_model import overrides


def copied_model(folder: Path, flags: list[str]) -> Path:
    """A run's model/ copied to ``folder``, its marker with it."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "dptext_origin.json").write_text(json.dumps({"written_by": "dptext", "kind": "run", "flags": flags}))
    return folder


@pytest.mark.parametrize("flags", [[], ["non_private"]])
def test_a_copied_model_folder_is_no_public_distill_student(tmp_path, flags):
    copy = copied_model(tmp_path / "elsewhere" / "my-model", flags)
    with pytest.raises(UserError, match="trained on private data"):
        check_public_student(str(copy))
    recipe = config.load_recipe(None, [
        "model.name=tiny-llama", "task.type=language_modeling", f"data.path={tmp_path / 'none.csv'}",
        "name=student", "privacy.target_epsilon=8", "distill.method=dp_sgd", f"distill.student={copy}"])
    with pytest.raises(UserError, match="distill.student"):
        run_distill(recipe, out=tmp_path / "student")
    assert not (tmp_path / "student" / "student_init").exists()


@pytest.mark.integration
def test_a_run_cut_off_after_saving_its_model_leaves_a_marker_in_it(reviews, tmp_path, monkeypatch):
    def cut_off(*_: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("dptext.finetune.run.maybe_write_curve", cut_off)
    first = tmp_path / "first"
    with pytest.raises(KeyboardInterrupt):
        run_finetune(config.load_recipe(None, overrides(reviews, "first") + ["privacy.enabled=false"]), out=first)
    assert (first / "model").is_dir() and not (first / "result.json").exists()
    copy = tmp_path / "elsewhere" / "my-model"
    shutil.copytree(first / "model", copy)
    assert start_model_flags(copy) == ["non_private"]


def test_a_copy_near_another_output_keeps_its_own_marker(tmp_path, monkeypatch):
    """A DPTrainer whose output_dir is the project folder: a non-private copy two folders below it stays so."""
    project = tmp_path / "project"
    copy = copied_model(project / "models" / "baseline", ["non_private"])
    write_manifest(project, "trainer", [])
    assert start_model_flags(copy) == ["non_private"]
    monkeypatch.chdir(project)
    assert start_model_flags("models/baseline") == ["non_private"]


@pytest.mark.integration
def test_a_start_model_gone_before_the_run_ends_still_counts(reviews, tmp_path, monkeypatch):
    """The copy (on scratch space, say) is removed while the run trains: what it learnt is still carried."""
    first = tmp_path / "first"
    run_finetune(config.load_recipe(None, overrides(reviews, "first") + ["privacy.enabled=false"]), out=first)
    copy = tmp_path / "scratch" / "my-model"
    shutil.copytree(first / "model", copy)
    from dptext.finetune import run as finetune_run

    def loop_then_clean(*args: object, **kwargs: object) -> object:
        done = original(*args, **kwargs)
        shutil.rmtree(copy)
        return done

    original = finetune_run.run_loop
    monkeypatch.setattr(finetune_run, "run_loop", loop_then_clean)
    run_finetune(config.load_recipe(None, overrides(reviews, "second", str(copy))), out=tmp_path / "second")
    assert not copy.exists()
    manifest = json.loads((tmp_path / "second" / "release.json").read_text())
    assert "non_private" in manifest["flags"]
