"""Canary sweep: plant unique strings in every field of tiny copies of each dataset family, run every subcommand
and task type tiny through the CLI, and check that no file outside the manifest's not_covered entries (and no
stdout/stderr) contains any of them: text and binary files, and token-id sequences in covered torch files.

Fields: text, labels (classes, intents, slot tags: mapped to a declared "other" class), slot values, ids, columns
the task ignores, dialog ids and senders, table values. Control codes are declared (task.code_domain), so a
canary code value is refused before training (tested in test_synth_codes.py); the canary sits in the text
the codes prefix instead. `dptext data` (which prints records on purpose) and `bench-memory` (no data) are
not run.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from dptext.cli.app import main
from dptext.models import load_tokenizer

pytestmark = pytest.mark.integration

FIELDS = ("text", "title", "label", "id", "ignored", "mr", "ref", "dialog", "sender", "word", "slot", "intent")
CANARY = {field: f"zq{field}canary{n:04d}x" for n, field in enumerate(FIELDS, start=4711)}
TINY = ["train.max_steps=2", "train.batch_size=8", "train.log_every=1", "privacy.target_epsilon=8",
        "data.max_length=48", "data.max_eval_examples=6", "eval.batch_size=8"]


# ---------------------------------------------------------------------------- tiny datasets with canaries

def text_family(root: Path) -> Path:
    """jsonl reviews: text, title, label (one canary label), id, a column no task reads, category/rating codes."""
    folder = root / "text"
    folder.mkdir()
    for split, size in (("train", 24), ("validation", 6), ("test", 6)):
        rows = []
        for i in range(size):
            planted = split == "train" and i == 3
            rows.append({"text": f"the food was {'good' if i % 2 else 'bad'} {CANARY['text'] if planted else i}",
                         "title": CANARY["title"] if planted else "a title",
                         "label": CANARY["label"] if planted else ("positive" if i % 2 else "negative"),
                         "id": CANARY["id"] if planted else f"r{i}", "ignored": CANARY["ignored"] if planted else "",
                         "category": "books" if i % 3 else "dvd", "rating": 5 if i % 2 else 1})
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def table_family(root: Path) -> Path:
    folder = root / "e2e"
    folder.mkdir()
    for name, size in (("trainset.csv", 16), ("devset.csv", 4), ("testset_w_refs.csv", 4)):
        with open(folder / name, "w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(["mr", "ref"])
            for i in range(size):
                planted = name == "trainset.csv" and i == 2
                venue = CANARY["mr"] if planted else f"Venue{i}"
                ref = f"{venue} is a pub {CANARY['ref'] if planted else 'nearby'}."
                writer.writerow([f"name[{venue}], eatType[pub]", ref])
    return folder


def dialog_family(root: Path) -> Path:
    dialogs = {}
    for d in range(10):
        planted = d < 5  # some of these dialogs land in training whatever the seeded split
        sender = CANARY["sender"] if planted else "alice"
        messages = [[{"text": f"hello there {d}", "sender": sender}],
                    [{"text": f"hi {CANARY['dialog'] if planted else 'friend'}", "sender": "bob"}],
                    [{"text": "how are you", "sender": sender}]]
        dialogs[f"{CANARY['id']}-{d}" if planted else f"dialog-{d}"] = {"messages": messages}
    path = root / "dialog.json"
    path.write_text(json.dumps(dialogs))
    return path


def slot_family(root: Path) -> Path:
    """ATIS layout: a canary word (a slot value), a canary slot tag and a canary intent in one training line."""
    folder = root / "atis"
    for split, size in (("train", 16), ("valid", 4), ("test", 4)):
        (folder / split).mkdir(parents=True)
        words, tags, labels = [], [], []
        for i in range(size):
            planted = split == "train" and i == 5
            city = CANARY["word"] if planted else "boston"
            words.append(f"fly to {city}")
            tags.append(f"O O B-{CANARY['slot'] if planted else 'city'}")
            labels.append(CANARY["intent"] if planted else ("flight" if i % 2 else "fare"))
        for name, lines in (("seq.in", words), ("seq.out", tags), ("label", labels)):
            (folder / split / name).write_text("\n".join(lines) + "\n")
    return folder


# ---------------------------------------------------------------------------- running commands

def cli(capsys, *args: str) -> dict:
    capsys.readouterr()
    with pytest.raises(SystemExit) as code:
        main([*args, "--json"])
    captured = capsys.readouterr()
    assert code.value.code == 0, captured.err[-2000:]
    for field, canary in CANARY.items():
        assert canary not in captured.out and canary not in captured.err, f"{field} canary printed by {args[0]}"
    return json.loads(captured.out)


def finetune(capsys, out: Path, *overrides: str) -> Path:
    recipe = out.parent / f"{out.name}.yaml"
    recipe.write_text(f"name: {out.name}\n")
    cli(capsys, "finetune", str(recipe), *TINY, *overrides, "--out", str(out))
    return out


TEXT = ["data.dataset=jsonl", "data.label_column=label"]
CLASSES = ["task.labels=[negative, positive, other]", "task.other_label=other"]
INTENTS = ["task.type=intent_slot", "data.dataset=atis", "task.intents=[flight, fare, other]",
           "task.slot_types=[city]", "task.other_label=other", "task.pooling=mean"]
CODES = ["task.control_codes=[category, rating]", "task.code_domain={category: [books, dvd], rating: [1, 5]}"]

RUNS = {  # name: (family, model, overrides)
    "classification": ("text", "tiny-bert", ["task.type=classification", *TEXT, *CLASSES,
                                             "audit.holdout_fraction=0.25"]),
    "infilling": ("text", "tiny-roberta", ["task.type=infilling", *TEXT, *CLASSES, "task.template=<S1> It was [MASK] .",
                                           "task.label_words=[b, g, o]"]),
    "language_modeling": ("text", "tiny-llama", ["task.type=language_modeling", *TEXT, *CODES]),
    "table_to_text": ("table", "tiny-gpt2", ["task.type=table_to_text", "data.dataset=e2e", "eval.beam_size=1",
                                             "eval.max_new_tokens=4"]),
    "dialog": ("dialog", "tiny-llama", ["task.type=dialog", "data.dataset=chitchat", "eval.beam_size=1",
                                        "eval.max_new_tokens=4", "data.validation_fraction=0.2"]),
    "intent_slot": ("slots", "tiny-bert", INTENTS),
    "intent_slot_clc": ("slots", "tiny-clc", [*INTENTS, "task.crf=true"]),
}
FAMILIES = {"text": text_family, "table": table_family, "dialog": dialog_family, "slots": slot_family}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("canary-data")
    return {name: build(root) for name, build in FAMILIES.items()}


# ---------------------------------------------------------------------------- the sweep

def canary_token_ids(model: str) -> list[list[int]]:
    tokenizer = load_tokenizer(model)
    if not callable(tokenizer):  # the clc word tokenizer: canaries are <unk>, no id sequence to look for
        return []
    return [tokenizer(c, add_special_tokens=False)["input_ids"] for c in CANARY.values()]


def integer_sequences(value):
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point() and 0 < value.numel() <= 1_000_000:
            yield value.flatten().tolist()
    elif isinstance(value, dict):
        for item in value.values():
            yield from integer_sequences(item)
    elif isinstance(value, (list, tuple)):
        if value and all(isinstance(v, int) for v in value):
            yield list(value)
        else:
            for item in value:
                yield from integer_sequences(item)


def contains(sequence: list[int], needle: list[int]) -> bool:
    return bool(needle) and any(sequence[i:i + len(needle)] == needle for i in range(len(sequence) - len(needle) + 1))


def sweep(folder: Path, token_ids: list[list[int]]) -> dict[str, str]:
    """Check every file of ``folder`` against its release.json; returns {path: status}."""
    manifest = json.loads((folder / "release.json").read_text())
    status = {f["path"]: f["status"] for f in manifest["files"]}
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert set(status) == on_disk, f"{folder}: files without a release status: {sorted(on_disk - set(status))}"
    for path, state in status.items():
        if state == "not_covered":
            continue
        raw = (folder / path).read_bytes()
        for field, canary in CANARY.items():
            assert canary.encode() not in raw, f"{field} canary in {folder.name}/{path} ({state})"
        if path.endswith(".pt"):
            loaded = torch.load(folder / path, map_location="cpu", weights_only=False)
            for sequence in integer_sequences(loaded):
                assert not any(contains(sequence, ids) for ids in token_ids), f"canary token ids in {path}"
    return status


@pytest.mark.parametrize("name", sorted(RUNS))
def test_finetune_outputs_hold_no_canary_outside_not_covered(name, data, tmp_path, capsys):
    family, model, overrides = RUNS[name]
    run = finetune(capsys, tmp_path / name, f"model.name={model}", f"data.path={data[family]}", *overrides)
    status = sweep(run, canary_token_ids(model))
    assert status["model/config.json"] in ("covered", "public") and status["result.json"] == "covered"
    shown = cli(capsys, "account", str(run))
    assert {f["path"] for f in shown["release"]["files"]} == set(status)
    if name == "classification":  # the audit folder holds the records: listed not covered, and the scan bites
        assert status["audit_not_private/members.jsonl"] == "not_covered"
        audit = b"".join(p.read_bytes() for p in (run / "audit_not_private").glob("*.jsonl"))
        assert any(c.encode() in audit for c in CANARY.values())  # the planted record is a member or held out
        cli(capsys, "mia", str(run))
        sweep(run, canary_token_ids(model))
    if name.startswith("intent_slot"):
        labels = json.loads((run / "model" / "intent_slot_labels.json").read_text())
        assert labels["intents"] == ["flight", "fare", "other"]


def test_synth_distill_and_decode_hold_no_canary(data, tmp_path, capsys):
    family, model, overrides = RUNS["language_modeling"]
    teacher = finetune(capsys, tmp_path / "teacher", f"model.name={model}", f"data.path={data[family]}", *overrides)
    synthetic = tmp_path / "synthetic"
    cli(capsys, "synth", str(teacher), "--out", str(synthetic), "--n", "12", "--batch-size", "6",
        "--max-new-tokens", "4", "--validation-fraction", "0.25", "--check-training-copies")
    ids = canary_token_ids(model)
    status = sweep(synthetic, ids)
    assert status["train.jsonl"] == "covered" and status["training_copies_not_private.json"] == "not_covered"
    recipe = tmp_path / "distill.yaml"
    recipe.write_text(json.dumps({"name": "student", "distill": {"method": "synthetic_only", "teacher": str(teacher),
                                                                 "synthetic": str(synthetic), "student_layers": [1]}}))
    student = tmp_path / "student"
    cli(capsys, "distill", str(recipe), *TINY, f"data.path={data[family]}", *TEXT, *CODES, "--out", str(student))
    sweep(student, ids)
    cli(capsys, "decode", "--model", str(teacher / "model"), "--prompt", "the food", "-T", "3", "--lambda", "0.5",
        "--seed", "1")
