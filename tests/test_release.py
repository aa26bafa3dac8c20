"""The release registry: every output file has a status, unregistered writes fail, `dptext account` prints it."""

from __future__ import annotations

import json

import pytest

from dptext import config, release
from dptext.cli.app import main
from dptext.finetune.setup import probe_records
from dptext.models import load_tokenizer
from dptext.runs import RunDir, atomic_write_json, write_manifest
from dptext.tasks import build_task


@pytest.fixture
def run(tmp_path):
    return RunDir.create(config.load_recipe(None, ["name=r"]), out=tmp_path / "run")


def test_a_new_run_directory_lists_its_files_with_their_status(run):
    manifest = json.loads((run.path / "release.json").read_text())
    assert {f["path"]: f["status"] for f in manifest["files"]} == {
        "release.json": "public", "resolved.yaml": "public", "provenance.json": "public"}
    assert set(manifest["statuses"]) == {"covered", "public", "not_covered"} and manifest["flags"] == {}


def test_writing_an_unregistered_file_fails(run):
    with pytest.raises(release.UnregisteredOutput, match="surprise.json"):
        atomic_write_json(run.path / "surprise.json", {})
    assert not (run.path / "surprise.json").exists()
    (run.path / "sneaked.txt").write_text("x")  # written around the registry: the manifest refuses it
    with pytest.raises(release.UnregisteredOutput, match="sneaked.txt"):
        write_manifest(run.path)


@pytest.mark.parametrize("path,status", [
    ("model/model.safetensors", "covered"), ("model/tokenizer.json", "public"),
    ("model/intent_slot_labels.json", "public"), ("checkpoints/step-00000003.pt", "not_covered"),
    ("checkpoints/LATEST", "covered"), ("diagnostics_not_private.jsonl", "not_covered"),
    ("audit_not_private/members.jsonl", "not_covered"),
    ("mia_not_private/references/ref-00/result.json", "not_covered"),
    ("metrics.jsonl", "covered"), ("ledger.json", "covered"),
])
def test_registry_statuses(path, status):
    assert release.entry_for(path, "run").status == status


def test_a_non_private_run_covers_nothing_it_learnt(tmp_path):
    run = RunDir.create(config.load_recipe(None, ["name=np", "privacy.enabled=false"]), out=tmp_path / "np")
    (run.path / "model").mkdir()
    (run.path / "model" / "model.safetensors").write_bytes(b"w")
    (run.path / "model" / "tokenizer.json").write_text("{}")
    manifest = write_manifest(run.path)
    status = {f["path"]: f["status"] for f in manifest["files"]}
    assert status["model/model.safetensors"] == "not_covered" and status["model/tokenizer.json"] == "public"
    assert "non_private" in manifest["flags"]


def test_reproducible_noise_makes_the_files_holding_the_seed_secret(tmp_path):
    recipe = config.load_recipe(None, ["name=rep", "privacy.reproducible_noise=true"])
    manifest = json.loads((RunDir.create(recipe, out=tmp_path / "rep").path / "release.json").read_text())
    status = {f["path"]: f["status"] for f in manifest["files"]}
    assert status["resolved.yaml"] == status["provenance.json"] == "not_covered"
    assert list(manifest["flags"]) == ["reproducible_noise"]


def test_edp_first_step_scaling_covers_nothing_learnt_and_is_inherited(tmp_path):
    recipe = config.load_recipe(None, ["name=fs", "privacy.method=edp_sgd", "privacy.edp_scaling=first_step"])
    teacher = RunDir.create(recipe, out=tmp_path / "fs")
    (teacher.path / "model").mkdir()
    (teacher.path / "model" / "model.safetensors").write_bytes(b"w")
    status = {f["path"]: f["status"] for f in write_manifest(teacher.path)["files"]}
    assert status["model/model.safetensors"] == "not_covered" and status["resolved.yaml"] == "public"
    assert release.inherited_flags(teacher.path) == ["data_dependent_scaling"]
    write_manifest(teacher.path, flags=["data_dependent_scaling", "reproducible_noise"])
    # the seed is the teacher's own (the student's files do not hold it), but the ε handed on rests on it
    assert release.inherited_flags(teacher.path) == ["data_dependent_scaling", "upstream_reproducible_noise"]
    student = tmp_path / "student"
    student.mkdir()
    (student / "resolved.yaml").write_text("name: s\n")
    found = write_manifest(student, flags=release.inherited_flags(teacher.path))
    assert {f["path"]: f["status"] for f in found["files"]}["resolved.yaml"] == "public"
    assert "that seed stays secret" in found["flags"]["upstream_reproducible_noise"]
    write_manifest(teacher.path, flags=["seeded_noise"])  # a seeded DPTrainer teacher
    assert release.inherited_flags(teacher.path) == ["upstream_reproducible_noise"]
    write_manifest(student, flags=["upstream_reproducible_noise"])  # a student's student carries it on
    assert release.inherited_flags(student) == ["upstream_reproducible_noise"]
    assert release.inherited_flags(tmp_path) == [] and release.inherited_flags(None) == []


def test_account_prints_the_manifest_of_a_synth_folder(tmp_path, capsys):
    folder = tmp_path / "synthetic"
    folder.mkdir()
    write_manifest(folder, "synth", ["exact_codes"])
    atomic_write_json(folder / "train.jsonl", [])
    write_manifest(folder)
    with pytest.raises(SystemExit) as code:
        main(["account", str(folder), "--json"])
    assert code.value.code == 0
    shown = json.loads(capsys.readouterr().out)
    status = {f["path"]: f["status"] for f in shown["release"]["files"]}
    assert status["train.jsonl"] == "not_covered" and "exact_codes" in shown["release"]["flags"]


@pytest.mark.parametrize("task_type,model,record", [
    ("classification", "tiny-bert", {"text": "SECRETWORD a", "label": 1}),
    ("language_modeling", "tiny-gpt2", {"text": "SECRETWORD b", "category": "SECRETCAT", "rating": 5}),
    ("intent_slot", "tiny-bert", {"tokens": ["SECRETWORD"], "tags": ["O"], "intent": "flight"}),
])
def test_memory_probe_examples_are_synthetic_and_of_maximum_length(task_type, model, record):
    overrides = [f"task.type={task_type}", f"model.name={model}", "data.dataset=sst2", "data.max_length=24",
                 "task.intents=[flight]", "task.slot_types=[city]"]
    if task_type == "language_modeling":
        overrides.append("task.control_codes=[category, rating]")
    recipe = config.load_recipe(None, overrides)
    tokenizer = load_tokenizer(model)
    task = build_task(recipe, tokenizer, [record])
    probes = probe_records(record, 3, recipe.data.max_length)
    assert len(probes) == 3 and "SECRET" not in json.dumps(probes)
    examples = task.encode(probes)
    assert all(len(e.input_ids) == recipe.data.max_length for e in examples)
    secret = tokenizer("SECRETWORD", add_special_tokens=False)["input_ids"]
    assert not any(secret == e.input_ids[i:i + len(secret)] for e in examples for i in range(len(e.input_ids)))
