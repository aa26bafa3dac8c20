"""The canary sweep's data and checks, shared by test_canary_release.py and test_canary_commands.py.

Unique strings (canaries) are planted in every field of tiny copies of each dataset family: text, labels
(classes, intents, slot tags: mapped to a declared "other" class), slot values, ids, columns the task ignores,
dialog ids and senders, table values. ``sweep`` then checks a run directory or synth folder against its
release.json: no canary in any file outside the not_covered entries (text and binary files, and token-id
sequences in covered torch files); ``cli`` checks that no canary is printed on stdout or stderr.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from dptext.cli.app import main
from dptext.models import load_tokenizer

FIELDS = ("text", "title", "label", "id", "ignored", "mr", "ref", "dialog", "sender", "word", "slot", "intent",
          "category")
CANARY = {field: f"zq{field}canary{n:04d}x" for n, field in enumerate(FIELDS, start=4711)}
TINY = ["train.max_steps=2", "train.batch_size=8", "train.log_every=1", "privacy.target_epsilon=8",
        "data.max_length=48", "data.max_eval_examples=6", "eval.batch_size=8"]


# ---------------------------------------------------------------------------- tiny datasets with canaries

def jsonl_folder(root: Path, name: str, sizes: tuple[int, int, int], row) -> Path:
    """train/validation/test.jsonl of ``row(i, planted)``; the planted record is the 4th training record."""
    folder = root / name
    folder.mkdir()
    for split, size in zip(("train", "validation", "test"), sizes):
        rows = [row(i, split == "train" and i == 3) for i in range(size)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def review(i: int, planted: bool) -> dict:
    return {"text": f"the food was {'good' if i % 2 else 'bad'} {CANARY['text'] if planted else i}",
            "title": CANARY["title"] if planted else "a title",
            "label": CANARY["label"] if planted else ("positive" if i % 2 else "negative"),
            "id": CANARY["id"] if planted else f"r{i}", "ignored": CANARY["ignored"] if planted else "",
            "category": "books" if i % 3 else "dvd", "rating": 5 if i % 2 else 1}


def text_family(root: Path) -> Path:
    """jsonl reviews: text, title, label (one canary label), id, a column no task reads, category/rating codes."""
    return jsonl_folder(root, "text", (24, 6, 6), review)


def coded_family(root: Path) -> Path:
    """The reviews with a canary control code too: training may read it (DP), `dptext synth` refuses it."""
    return jsonl_folder(root, "coded", (24, 6, 6),
                        lambda i, planted: {**review(i, planted),
                                            **({"category": CANARY["category"]} if planted else {})})


def numbered_family(root: Path) -> Path:
    """jsonl with class ids 0/1 and one training record with the stray id 7 and a canary text."""
    return jsonl_folder(root, "numbered", (12, 4, 4), lambda i, planted: {
        "text": CANARY["text"] if planted else f"review {i}", "label": 7 if planted else i % 2})


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


FAMILIES = {"text": text_family, "coded": coded_family, "numbered": numbered_family, "table": table_family,
            "dialog": dialog_family, "slots": slot_family}

TEXT = ["data.dataset=jsonl", "data.label_column=label"]
CLASSES = ["task.labels=[negative, positive, other]", "task.other_label=other"]
INTENTS = ["task.type=intent_slot", "data.dataset=atis", "task.intents=[flight, fare, other]",
           "task.slot_types=[city]", "task.other_label=other", "task.pooling=mean"]
CODES = ["task.control_codes=[category, rating]", "task.code_domain={category: [books, dvd], rating: [1, 5]}"]
CLASSIFICATION = ["task.type=classification", *TEXT, *CLASSES]

RUNS = {  # name: (family, model, overrides)
    "classification": ("text", "tiny-bert", [*CLASSIFICATION, "audit.holdout_fraction=0.25"]),
    "classification_edp": ("text", "tiny-bert", [*CLASSIFICATION, "privacy.method=edp_sgd",
                                                 "privacy.edp_micro_batches_per_device=2"]),
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


def run_arguments(name: str, data: dict[str, Path], family: str | None = None) -> list[str]:
    default, model, overrides = RUNS[name]
    return [f"model.name={model}", f"data.path={data[family or default]}", *overrides]


def build_data(root: Path) -> dict[str, Path]:
    return {name: build(root) for name, build in FAMILIES.items()}


# ---------------------------------------------------------------------------- running commands

def assert_no_canary(text: str, where: str) -> None:
    for field, canary in CANARY.items():
        assert canary not in text, f"{field} canary in {where}"


def cli(capsys, *args: str, code: int = 0) -> dict | str:
    """Run ``dptext ARGS --json``: the parsed JSON result (exit 0), or stderr (``code`` ≠ 0, e.g. a refusal);
    either way nothing printed may hold a canary."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--json"])
    captured = capsys.readouterr()
    assert exit_.value.code == code, captured.err[-2000:]
    assert_no_canary(captured.out + captured.err, f"the output of dptext {args[0]}")
    return json.loads(captured.out) if code == 0 else captured.err


def write_recipe(path: Path) -> Path:
    path.write_text(f"name: {path.stem}\n")
    return path


def finetune(capsys, out: Path, *overrides: str) -> Path:
    cli(capsys, "finetune", str(write_recipe(out.parent / f"{out.name}.yaml")), *TINY, *overrides, "--out", str(out))
    return out


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


def scan_file(path: Path, token_ids: list[list[int]], where: str) -> None:
    raw = path.read_bytes()
    for field, canary in CANARY.items():
        assert canary.encode() not in raw, f"{field} canary in {where}"
    if path.suffix == ".pt":
        loaded = torch.load(path, map_location="cpu", weights_only=False)
        for sequence in integer_sequences(loaded):
            assert not any(contains(sequence, ids) for ids in token_ids), f"canary token ids in {where}"


def sweep(folder: Path, token_ids: list[list[int]]) -> dict[str, str]:
    """Check every file of ``folder`` against its release.json; returns {path: status}."""
    manifest = json.loads((folder / "release.json").read_text())
    status = {f["path"]: f["status"] for f in manifest["files"]}
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert set(status) == on_disk, f"{folder}: files without a release status: {sorted(on_disk - set(status))}"
    for path, state in status.items():
        if state != "not_covered":
            scan_file(folder / path, token_ids, f"{folder.name}/{path} ({state})")
    return status
