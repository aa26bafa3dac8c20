"""ATIS and SNIPS joint intent detection and slot filling (the Goo et al. 2018 splits).

Records: ``{"tokens": [...], "tags": [...], "intent": str}`` with one BIO slot tag per token;
multi-intent utterances join their intents with ``#`` (``atis_flight#atis_airfare``).

Local files: ``{train,valid,test}/{seq.in,seq.out,label}``, one utterance per line, aligned
line by line. Lines are split on any whitespace because SNIPS ends every ``seq.out`` line
(and some ``seq.in`` lines) with a space. A line whose token and tag counts differ is an
error naming the file and line: silently truncating would mislabel every later token.

Hub (no official copy exists; these are the public joint intent+slot copies in use):
* ATIS: ``tuetschek/atis`` (csv, columns ``id, intent, text, slots``; ``train`` is the
  4,978 utterances of train+dev, ``test`` the 893 of test; intents have no ``atis_`` prefix and
  join multiple intents with ``+``, normalised here to the local form). dptext takes a seeded
  500-utterance validation split out of the hub's train so that train keeps the standard
  4,478 utterances (the published size that privacy accounting uses).
* SNIPS: ``bkonkle/snips-joint-intent`` (csv, columns ``input, intent, slots``; ``train`` the
  standard 13,084, ``test`` the standard 700). It lacks the standard validation file, so
  validation and test are seeded halves of its test split, leaving train untouched. Hub
  rows whose token and tag counts differ are dropped with a warning.
Hub records also carry ``hub_index``, the row's position in its hub split (the split key).
Pass ``data.path=`` to a local copy for the exact standard splits.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional

from dptext.data.files import data_folder, file_in
from dptext.data.hub import load_hub_split
from dptext.data.splits import canonical_split, halve_seeded, seeded_order
from dptext.errors import UserError

FOLDERS = {"train": "train", "validation": "valid", "test": "test"}
HUB_IDS = {"atis": "tuetschek/atis", "snips": "bkonkle/snips-joint-intent"}
PUBLISHED_TRAIN_SIZES = {"atis": 4_478, "snips": 13_084}
ATIS_VALIDATION_SIZE = 500


def _lines(path: Path) -> list[str]:
    # split at '\n' only: str.splitlines() would also split inside a line at U+0085 or U+2028 and misalign files
    lines = [line.removesuffix("\r") for line in path.read_text(encoding="utf-8").split("\n")]
    return lines[:-1] if lines and lines[-1] == "" else lines


def read_seq_folder(folder: Path, dataset: str) -> list[dict[str, Any]]:
    """One split folder holding ``seq.in``, ``seq.out`` and ``label``."""
    words_file, tags_file, label_file = (file_in(folder, n, dataset) for n in ("seq.in", "seq.out", "label"))
    words, tags, labels = _lines(words_file), _lines(tags_file), _lines(label_file)
    if not len(words) == len(tags) == len(labels):
        raise UserError(f"{folder} has {len(words)} lines in seq.in, {len(tags)} in seq.out and {len(labels)} in "
                        "label; the three files must align line by line.")
    records = []
    for line_number, (word_line, tag_line, label) in enumerate(zip(words, tags, labels), start=1):
        tokens, token_tags = word_line.split(), tag_line.split()
        if len(tokens) != len(token_tags):
            raise UserError(f"{tags_file} line {line_number} has {len(token_tags)} tags for the {len(tokens)} tokens "
                            f"of {words_file.name} line {line_number}; each token needs exactly one tag.")
        records.append({"tokens": tokens, "tags": token_tags, "intent": label.strip()})
    return records


def _atis_intent(hub_intent: str) -> str:
    parts = [p.strip() for p in hub_intent.split("+")]
    return "#".join(p if p.startswith("atis_") else f"atis_{p}" for p in parts)


def _hub_records(dataset: str, hub_split: str) -> list[dict[str, Any]]:
    rows = load_hub_split(dataset, HUB_IDS[dataset], hub_split)
    text_column = "text" if dataset == "atis" else "input"
    records, dropped = [], 0
    for index, row in enumerate(rows):
        tokens, tags = str(row[text_column]).split(), str(row["slots"]).split()
        if len(tokens) != len(tags):
            dropped += 1
            continue
        intent = _atis_intent(row["intent"]) if dataset == "atis" else str(row["intent"]).strip()
        records.append({"tokens": tokens, "tags": tags, "intent": intent, "hub_index": index})
    if dropped:
        warnings.warn(f"{HUB_IDS[dataset]} {hub_split}: dropped {dropped} rows whose token and tag counts differ")
    return records


def _from_hub(dataset: str, split: str, seed: int) -> list[dict[str, Any]]:
    def by_index(record):
        return str(record["hub_index"])

    if dataset == "atis":
        if split == "test":
            return _hub_records(dataset, "test")
        train = _hub_records(dataset, "train")
        # Exactly 500 held out (not a fraction), so train has the standard 4,478 utterances.
        held = set(seeded_order((by_index(r) for r in train), seed)[:ATIS_VALIDATION_SIZE])
        return [r for r in train if (by_index(r) in held) == (split == "validation")]
    if split == "train":
        return _hub_records(dataset, "train")
    return halve_seeded(_hub_records(dataset, "test"), split, by_index, seed)


def read_intent_slots(dataset: str, split: str, path: Optional[str] = None,
                      split_seed: int = 0) -> list[dict[str, Any]]:
    split = canonical_split(split)
    if path is None:
        return _from_hub(dataset, split, split_seed)
    root = data_folder(path, dataset, "train/, valid/ and test/ folders with seq.in, seq.out and label")
    folder = root / FOLDERS[split]
    if not folder.is_dir():
        raise UserError(f"The {dataset} folder {root} has no {FOLDERS[split]}/ subfolder; it needs train/, valid/ "
                        "and test/, each with seq.in, seq.out and label.")
    return read_seq_folder(folder, dataset)


def read_atis(split: str, path: Optional[str] = None, split_seed: int = 0, **_options) -> list[dict[str, Any]]:
    return read_intent_slots("atis", split, path, split_seed)


def read_snips(split: str, path: Optional[str] = None, split_seed: int = 0, **_options) -> list[dict[str, Any]]:
    return read_intent_slots("snips", split, path, split_seed)
