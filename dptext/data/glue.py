"""GLUE sentence(-pair) classification: SST-2, QNLI, MNLI (matched), QQP.

Records: ``{"text": str, "text_pair": str | None, "label": int | None, "label_name": str | None}``
plus the task's original columns (``sentence``, ``question1``, ``genre``, ...). ``text`` and
``text_pair`` have surrounding whitespace stripped (GLUE's SST-2 ends every sentence with a
space); the original columns are kept as they are. ``label`` indexes ``LABEL_NAMES[task]``;
test splits carry no labels in GLUE, so their ``label`` is None.

Local files: the GLUE task folder (``SST-2/``, ``QNLI/``, ``MNLI/``, ``QQP/``) with
``train.tsv``, ``dev.tsv`` (MNLI: ``dev_matched.tsv``) and ``test.tsv`` (MNLI:
``test_matched.tsv``): tab-separated with a header, no quoting (``csv.QUOTE_NONE``: a quote
character is ordinary text). Column names come from each file's header.

Hub: ``nyu-mll/glue`` with the task as config (the former canonical ``glue``); MNLI's
validation and test are ``validation_matched`` / ``test_matched``.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from dptext.data.files import data_folder, file_in
from dptext.data.hub import load_hub_split
from dptext.data.splits import canonical_split
from dptext.errors import UserError

HUB_ID = "nyu-mll/glue"

LABEL_NAMES = {
    "sst2": ("negative", "positive"),
    "qnli": ("entailment", "not_entailment"),
    "mnli": ("entailment", "neutral", "contradiction"),
    "qqp": ("not_duplicate", "duplicate"),
}
PUBLISHED_TRAIN_SIZES = {"sst2": 67_349, "qnli": 104_743, "mnli": 392_702, "qqp": 363_846}


@dataclass(frozen=True)
class GlueLayout:
    """Where one task keeps its text, pair and label, locally and on the hub."""

    files: dict
    text: str
    pair: Optional[str]
    label: str
    hub_text: str
    hub_pair: Optional[str]
    hub_splits: dict


_STANDARD_FILES = {"train": "train.tsv", "validation": "dev.tsv", "test": "test.tsv"}
_STANDARD_HUB_SPLITS = {"train": "train", "validation": "validation", "test": "test"}
LAYOUTS = {
    "sst2": GlueLayout(_STANDARD_FILES, "sentence", None, "label", "sentence", None, _STANDARD_HUB_SPLITS),
    "qnli": GlueLayout(_STANDARD_FILES, "question", "sentence", "label", "question", "sentence", _STANDARD_HUB_SPLITS),
    "mnli": GlueLayout(
        {"train": "train.tsv", "validation": "dev_matched.tsv", "test": "test_matched.tsv"},
        "sentence1", "sentence2", "gold_label", "premise", "hypothesis",
        {"train": "train", "validation": "validation_matched", "test": "test_matched"},
    ),
    "qqp": GlueLayout(_STANDARD_FILES, "question1", "question2", "is_duplicate", "question1", "question2",
                      _STANDARD_HUB_SPLITS),
}


def _label_index(task: str, value: Any, where: str) -> Optional[int]:
    """GLUE labels come as names (QNLI, MNLI), digit strings (SST-2, QQP) or ints (hub, -1 = none)."""
    names = LABEL_NAMES[task]
    if value is None or value == "" or value == -1:
        return None
    if isinstance(value, int):
        return value
    if value in names:
        return names.index(value)
    if value.strip().isdigit() and int(value) < len(names):
        return int(value)
    raise UserError(f"{where} has a label that is not one of {task}'s labels {list(names)} or their indices; fix "
                    "that record (its value is not shown: the data may be private).")


def _normalised(task: str, row: dict, text: str, pair: Optional[str], label: Any, where: str) -> dict[str, Any]:
    index = _label_index(task, label, where)
    return {
        **row,
        "text": text.strip(),
        "text_pair": pair.strip() if pair is not None else None,
        "label": index,
        "label_name": LABEL_NAMES[task][index] if index is not None else None,
    }


def read_glue_tsv(task: str, path: Path) -> list[dict[str, Any]]:
    layout = LAYOUTS[task]
    with open(path, encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        columns = reader.fieldnames or []
        needed = [layout.text] + ([layout.pair] if layout.pair else [])
        missing = [c for c in needed if c not in columns]
        if missing:
            raise UserError(f"{path} has no column {missing[0]!r} (its header has {', '.join(columns)}); "
                            f"is it a GLUE {task} file?")
        records = []
        for line_number, row in enumerate(reader, start=2):
            if None in row or any(row.get(c) is None for c in needed):
                raise UserError(f"{path} line {line_number} has {len(columns)} columns in its header but a different "
                                "number of tab-separated fields in the row.")
            pair = row[layout.pair] if layout.pair else None
            records.append(_normalised(task, row, row[layout.text], pair, row.get(layout.label),
                                       f"{path} line {line_number}"))
    return records


def read_glue(task: str, split: str, path: Optional[str] = None) -> list[dict[str, Any]]:
    split = canonical_split(split)
    layout = LAYOUTS[task]
    if path is not None:
        folder = data_folder(path, task, ", ".join(layout.files.values()))
        return read_glue_tsv(task, file_in(folder, layout.files[split], task))
    rows = load_hub_split(task, HUB_ID, layout.hub_splits[split], config=task)
    where = f"{HUB_ID} ({task}) {split}"
    return [
        _normalised(task, row, row[layout.hub_text], row[layout.hub_pair] if layout.hub_pair else None,
                    row.get("label"), where)
        for row in rows
    ]


def read_sst2(split: str, path: Optional[str] = None, **_options) -> list[dict[str, Any]]:
    return read_glue("sst2", split, path)


def read_qnli(split: str, path: Optional[str] = None, **_options) -> list[dict[str, Any]]:
    return read_glue("qnli", split, path)


def read_mnli(split: str, path: Optional[str] = None, **_options) -> list[dict[str, Any]]:
    return read_glue("mnli", split, path)


def read_qqp(split: str, path: Optional[str] = None, **_options) -> list[dict[str, Any]]:
    return read_glue("qqp", split, path)
