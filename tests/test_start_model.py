"""A fine-tuning run that starts from a model dptext trained (``dptext.finetune.start_model``): it carries that
run's flags and says so. Before, ``model.name=RUN_DIR/model`` was taken as any folder and the new run reported its
own ε alone — silently, even when the start model had trained on the private data without DP."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dptext import config
from dptext.finetune import run_finetune
from dptext.finetune.start_model import copied_model_flags, dptext_output_of, start_model_flags
from dptext.output import Output
from dptext.release import FLAG_REASONS
from dptext.runs import write_manifest

pytestmark = pytest.mark.integration


def overrides(data: Path, name: str, model: str = "tiny-bert") -> list[str]:
    return [f"model.name={model}", "task.type=classification", f"data.path={data}", "data.max_length=16",
            "data.max_eval_examples=4", "train.batch_size=8", "train.max_steps=2", "eval.split=validation",
            f"name={name}", "task.labels=[negative,positive]", "privacy.target_epsilon=8"]


def released(run: Path) -> tuple[dict, dict]:
    manifest = json.loads((run / "release.json").read_text())
    return manifest["flags"], {f["path"]: f["status"] for f in manifest["files"]}


def test_only_a_folder_in_a_dptext_output_counts(tmp_path):
    assert dptext_output_of("tiny-bert") is None and start_model_flags("tiny-bert") == []
    (tmp_path / "plain").mkdir()
    assert dptext_output_of(tmp_path / "plain") is None
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    write_manifest(run, "run", ["clipping_not_verified", "reproducible_noise"])
    assert dptext_output_of(run / "model") == run and dptext_output_of(run) == run
    assert start_model_flags(run / "model") == ["clipping_not_verified", "upstream_reproducible_noise",
                                                "continued_from_private_model"]
    write_manifest(run, "run", ["non_private"])
    assert start_model_flags(run / "model") == ["non_private"]  # nothing private with DP to continue from


def test_a_copied_dptrainer_checkpoint_carries_its_privacy_reports_flags(tmp_path):
    """A DPTrainer's checkpoint-N/ holds its privacy.json (written_by dptext.DPTrainer, with the trainer's flags): a
    copy outside output_dir is known by it; a privacy.json another tool wrote is not a marker."""
    copy = tmp_path / "checkpoint-copy"
    copy.mkdir()
    (copy / "privacy.json").write_text(json.dumps({"epsilon": 3.0, "flags": ["seeded_noise"]}))
    assert start_model_flags(copy) == []  # not a DPTrainer's report
    (copy / "privacy.json").write_text(json.dumps({"written_by": "dptext.DPTrainer", "flags": ["seeded_noise"]}))
    assert start_model_flags(copy) == ["upstream_reproducible_noise", "continued_from_private_model"]
    (copy / "privacy.json").write_text(json.dumps({"written_by": "dptext.DPTrainer", "flags": ["no_noise"]}))
    assert start_model_flags(copy) == ["no_noise", "continued_from_private_model"]


@pytest.mark.parametrize("listed, carried", [
    ([], ["continued_from_private_model"]),
    (["non_private"], ["non_private"]),
    (["clipping_not_verified", "reproducible_noise"], ["clipping_not_verified", "upstream_reproducible_noise",
                                                       "continued_from_private_model"]),
    ("non_private", ["non_private"]),  # not a list: unreadable, so taken as non-private
    (None, ["non_private"]),
])
def test_a_copied_model_folder_carries_the_flags_of_its_marker(tmp_path, listed, carried):
    copy = tmp_path / "copy"
    copy.mkdir()
    assert copied_model_flags(copy) == [] and start_model_flags(copy) == []  # no marker: any folder
    (copy / "dptext_origin.json").write_text("{not json" if listed is None else json.dumps({"flags": listed}))
    assert copied_model_flags(copy) == carried and start_model_flags(copy) == carried


@pytest.mark.parametrize("first_private", [True, False])
def test_a_run_from_a_model_dptext_trained_carries_its_flags_and_warns(reviews, tmp_path, capsys, first_private):
    first = tmp_path / "first"
    run_finetune(config.load_recipe(None, overrides(reviews, "first") + ([] if first_private else
                                                                      ["privacy.enabled=false"])), out=first)
    second = tmp_path / "second"
    run_finetune(config.load_recipe(None, overrides(reviews, "second", str(first / "model"))), out=second,
                 output=Output())
    flags, statuses = released(second)
    assert "model.name is a model dptext trained" in capsys.readouterr().err
    if first_private:
        assert "continued_from_private_model" in flags and "compose" in flags["continued_from_private_model"]
        assert statuses["model/model.safetensors"] == "covered"
    else:  # the start model learnt the private data without noise: nothing the second run learnt is covered
        assert "non_private" in flags and flags["non_private"] == FLAG_REASONS["non_private"]
        assert statuses["model/model.safetensors"] == "not_covered"
    first_flags, first_statuses = released(first)
    assert first_statuses["model/dptext_origin.json"] == "public"
    assert json.loads((first / "model" / "dptext_origin.json").read_text())["flags"] == sorted(first_flags)
    copy = tmp_path / "elsewhere" / "my-model"  # model/ copied out of its run: its marker goes with it
    shutil.copytree(first / "model", copy)
    from_copy = tmp_path / "from_copy"
    run_finetune(config.load_recipe(None, overrides(reviews, "from_copy", str(copy))), out=from_copy,
                 output=Output())
    assert "model.name is a model dptext trained" in capsys.readouterr().err
    assert released(from_copy) == (flags, statuses)
    fresh = tmp_path / "fresh"
    run_finetune(config.load_recipe(None, overrides(reviews, "fresh")), out=fresh)
    assert released(fresh)[0] == {}
