"""E2E NLG (Novikova et al. 2017): restaurant meaning representations and their references.

Records: ``{"mr": "name[The Vaults], eatType[pub], ...", "ref": "The Vaults pub near ..."}``,
one per human reference (several consecutive rows share an MR; the splits use disjoint MRs).
Use ``dptext.data.group_references`` to get all references of each MR for evaluation.

Local files: the official release folder with ``trainset.csv``, ``devset.csv`` and
``testset_w_refs.csv``. They are RFC 4180 CSV with quoted newlines inside two training
references, CRLF line endings in train/dev and a quoted header in the test file, so they are
read with the ``csv`` module, never split on lines.

Hub: ``tuetschek/e2e_nlg`` (the former canonical ``e2e_nlg``; columns
``meaning_representation``, ``human_reference``), read from its Parquet export because the
main branch holds a loading script that ``datasets`` 4+ no longer runs.
"""

from __future__ import annotations

import csv
from typing import Optional

from dptext.data.files import data_folder, file_in
from dptext.data.hub import PARQUET_EXPORT, load_hub_split
from dptext.data.splits import canonical_split
from dptext.errors import UserError

HUB_ID = "tuetschek/e2e_nlg"
FILES = {"train": "trainset.csv", "validation": "devset.csv", "test": "testset_w_refs.csv"}
PUBLISHED_TRAIN_SIZE = 42_061


def read_e2e_csv(path) -> list[dict[str, str]]:
    """Rows of one E2E csv file as ``{"mr", "ref"}`` records."""
    # newline="" lets the csv module see the quoted CR/LF inside fields and keep them.
    with open(path, encoding="utf-8", newline="") as handle:
        rows = csv.reader(handle)
        header = [h.strip().lower() for h in next(rows, [])]
        if header[:2] != ["mr", "ref"]:
            raise UserError(f"{path} does not look like an E2E file: its header is {header}, expected mr,ref.")
        records = []
        for line_number, row in enumerate(rows, start=2):
            if len(row) != 2:
                raise UserError(f"{path} row {line_number} has {len(row)} fields, expected 2 (mr, ref).")
            records.append({"mr": row[0], "ref": row[1]})
    return records


def read_e2e(split: str, path: Optional[str] = None, **_options) -> list[dict[str, str]]:
    split = canonical_split(split)
    if path is not None:
        folder = data_folder(path, "e2e", ", ".join(FILES.values()))
        return read_e2e_csv(file_in(folder, FILES[split], "e2e"))
    rows = load_hub_split("e2e", HUB_ID, split, revision=PARQUET_EXPORT, data_dir="default")
    return [{"mr": row["meaning_representation"], "ref": row["human_reference"]} for row in rows]
