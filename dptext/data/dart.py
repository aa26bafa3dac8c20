"""DART v1.1.1 (Nan et al. 2021): open-domain RDF triple sets and their descriptions.

Records: one per reference, ``{"tripleset": [[subject, predicate, object], ...], "ref": str,
"source": annotation source, "entry": index of the triple set in its file}``. ``entry``
identifies the input even where two entries hold the same triples (47 dev entries repeat
another's); ``dptext.data.group_references(records)`` groups by it for multi-reference evaluation.

Local files: a folder with ``dart-v1.1.1-full-{train,dev,test}.json`` (a list of
``{"tripleset", "annotations": [{"source", "text"}]}``) or the WebNLG-style ``.xml`` of the
same name (``<entry>`` with ``<mtriple>s | p | o</mtriple>`` and ``<lex comment=SOURCE>``);
JSON is preferred when both exist. Published sizes (references): train 62,659, dev 6,980,
test 12,552 (82,191 in all; 30,526 / 2,768 / 5,097 triple sets).

Hub: ``Yale-LILY/dart`` (the former canonical ``dart``), read from its Parquet export
because its main branch holds a loading script that ``datasets`` 4+ no longer runs.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any, Optional

from dptext.data.files import data_folder
from dptext.data.hub import PARQUET_EXPORT, load_hub_split
from dptext.data.splits import canonical_split
from dptext.errors import UserError

HUB_ID = "Yale-LILY/dart"
FILE_SPLIT = {"train": "train", "validation": "dev", "test": "test"}
PUBLISHED_TRAIN_SIZE = 62_659


def _record(tripleset: list, ref: str, source: str, entry: int) -> dict[str, Any]:
    return {"tripleset": tripleset, "ref": ref, "source": source, "entry": entry}


def read_dart_json(path: Path) -> list[dict[str, Any]]:
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc}); expected a DART json file.") from None
    records = []
    for index, entry in enumerate(entries):
        triples = [list(t) for t in entry["tripleset"]]
        for annotation in entry["annotations"]:
            records.append(_record(triples, annotation["text"], annotation["source"], index))
    return records


def read_dart_xml(path: Path) -> list[dict[str, Any]]:
    try:
        root = ElementTree.parse(path).getroot()
    except ElementTree.ParseError as exc:
        raise UserError(f"{path} is not well-formed XML ({exc}); expected a DART xml file.") from None
    records = []
    for index, entry in enumerate(root.iter("entry")):
        triples = []
        for mtriple in entry.iter("mtriple"):
            parts = (mtriple.text or "").split(" | ")
            if len(parts) != 3:
                # by position, never the triple's text or the entry's id: the records may be private data
                raise UserError(f"{path} entry {index + 1} (counting from 1) has a triple with {len(parts)} parts "
                                "instead of 3 (subject | predicate | object); fix that entry.")
            triples.append(parts)
        for lex in entry.iter("lex"):
            records.append(_record(triples, lex.text or "", lex.get("comment", ""), index))
    return records


def _local_file(folder: Path, split: str) -> Path:
    stem = FILE_SPLIT[split]
    for suffix in (".json", ".xml"):
        matches = sorted(folder.glob(f"dart-*-full-{stem}{suffix}"))
        if matches:
            return matches[-1]  # the newest version when several are present
    present = ", ".join(sorted(p.name for p in folder.glob("dart-*"))) or "no DART files"
    raise UserError(
        f"DART has no {split} file in {folder} (looked for dart-*-full-{stem}.json or .xml; found {present}); "
        "get it from the Yale-LILY/dart repository (data/v1.1.1) or leave data.path empty to use the hub."
    )


def read_dart(split: str, path: Optional[str] = None, **_options) -> list[dict[str, Any]]:
    split = canonical_split(split)
    if path is not None:
        folder = data_folder(path, "dart", "dart-v1.1.1-full-{train,dev,test}.json or .xml")
        file = _local_file(folder, split)
        return read_dart_json(file) if file.suffix == ".json" else read_dart_xml(file)
    rows = load_hub_split("dart", HUB_ID, split, revision=PARQUET_EXPORT, data_dir="default")
    records = []
    for index, row in enumerate(rows):
        annotations = row["annotations"]
        # The hub stores a sequence of structs as a dict of lists; accept a list of dicts too.
        if isinstance(annotations, dict):
            annotations = [dict(zip(annotations, values)) for values in zip(*annotations.values())]
        triples = [list(t) for t in row["tripleset"]]
        for annotation in annotations:
            records.append(_record(triples, annotation["text"], annotation["source"], index))
    return records
