"""Your own data: jsonl, csv or tsv files with named columns.

Records: every column of the file, plus ``"text"`` (from ``text_column``, default ``text``)
and ``"label"`` (from ``label_column``, if given) and ``"user"`` (from ``user_column``, if given: the trimmed value as
text, None where it is missing or blank; see ``dptext.data.users``). Labels written as whole numbers (``3``,
``"3"``) become ints; other labels stay strings for the task to map.

``data.path`` is either one file, split by the seeded partition (``validation_fraction``
each for validation and test; by user when ``user_column`` is given, so validation and test hold other users
than training), or a folder with one file per split: ``train.<ext>``, ``validation.<ext>`` (or
``dev``/``valid``) and ``test.<ext>`` (split as you wrote them).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Optional

from dptext.data.files import existing_path
from dptext.data.splits import canonical_split, seeded_split, user_split
from dptext.data.users import USER, user_id
from dptext.errors import UserError
from dptext.textfiles import undecodable, unreadable

SPLIT_FILE_STEMS = {"train": ("train",), "validation": ("validation", "dev", "valid", "val"), "test": ("test",)}
EXTENSIONS = {"jsonl": (".jsonl", ".json"), "csv": (".csv",), "tsv": (".tsv",)}


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8-sig") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path} line {line_number} is not valid JSON ({exc.msg}); "
                                "jsonl needs one JSON object per line.") from None
            if not isinstance(row, dict):
                raise UserError(f"{path} line {line_number} is a JSON {type(row).__name__}, "
                                "not an object with columns.")
            rows.append(row)
    return rows


def _read_delimited(path: Path, delimiter: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8-sig", newline="") as handle:  # -sig: a spreadsheet's byte-order mark
        reader = csv.DictReader(handle, delimiter=delimiter)
        repeated = sorted({name for name in reader.fieldnames or [] if (reader.fieldnames or []).count(name) > 1})
        if repeated:  # csv keeps the last of two same-named columns without a word
            raise UserError(f"{path}'s header names the column(s) {', '.join(map(repr, repeated))} more than once; "
                            "give every column its own name.")
        rows = []
        try:
            for line_number, row in enumerate(reader, start=2):
                if None in row:
                    raise UserError(f"{path} row {line_number} has more fields than the header's "
                                    f"{len(reader.fieldnames or [])} columns.")
                if None in row.values():  # e.g. a quote opened in the last row of a file cut short
                    raise UserError(f"{path} row {line_number} has fewer fields than the header's "
                                    f"{len(reader.fieldnames or [])} columns (a quote that never closes, or a file "
                                    "cut short?); give every row a value for every column.")
                if any("\x00" in value for value in row.values()):  # csv reads NUL as text; jsonl and recipes refuse it
                    raise UserError(f"{path} row {line_number} holds a NUL byte (a binary or damaged file?); save it "
                                    "as plain UTF-8 text.")
                rows.append(row)
        except csv.Error as exc:  # e.g. a field over csv's size limit: a quote that never closes in a large file
            raise UserError(f"{path} is not readable as {'TSV' if delimiter == chr(9) else 'CSV'} near line "
                            f"{reader.line_num} ({exc}); check its quoting.") from None
    return rows


def _as_label(value: Any) -> Any:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _records(rows: list[dict[str, Any]], path: Path, text_column: Optional[str], label_column: Optional[str],
             user_column: Optional[str] = None):
    text_column = text_column or "text"
    columns = list(rows[0]) if rows else []
    for wanted, option in ((text_column, "data.text_column"), (label_column, "data.label_column"),
                           (user_column, "data.user_column")):
        if wanted is not None and rows and wanted not in rows[0]:
            raise UserError(f"{path} has no column {wanted!r} (it has {', '.join(map(str, columns))}); "
                            f"set {option} to one of them.")
    records = []
    for row in rows:
        record = {**row, "text": row.get(text_column)}
        if label_column is not None:
            record["label"] = _as_label(row.get(label_column))
        if user_column is not None:
            record[USER] = user_id(row.get(user_column))
        records.append(record)
    return records


def _read_json_array(path: Path) -> list[dict[str, Any]]:
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc.msg}); use a list of objects, or one object per line "
                        "in a .jsonl file.") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise UserError(f"{path} must hold a JSON list of objects (one per example).")
    return rows


def read_table_file(path: Path, text_column: Optional[str] = None, label_column: Optional[str] = None,
                    user_column: Optional[str] = None):
    readers = {".jsonl": _read_jsonl, ".json": _read_json_array, ".csv": lambda p: _read_delimited(p, ","),
               ".tsv": lambda p: _read_delimited(p, "\t")}
    if path.suffix not in readers:
        raise UserError(f"{path} is not a .jsonl, .csv or .tsv file; dptext reads generic data only in those formats.")
    try:
        rows = readers[path.suffix](path)
    except UnicodeDecodeError:  # gzip named .csv, a Latin-1 byte, UTF-16: what it is, or the line and byte
        raise undecodable(path, "data file") from None
    except OSError as exc:  # no permission, a folder named .csv, a symlink loop
        raise unreadable(path, "data file", exc) from None
    return _records(rows, path, text_column, label_column, user_column)


def _split_file(folder: Path, split: str, kind: str) -> Path:
    for stem in SPLIT_FILE_STEMS[split]:
        for extension in EXTENSIONS[kind]:
            if (folder / f"{stem}{extension}").is_file():
                return folder / f"{stem}{extension}"
    names = " or ".join(f"{s}{EXTENSIONS[kind][0]}" for s in SPLIT_FILE_STEMS[split])
    raise UserError(f"{folder} has no {split} file ({names}); add it, or pass a single file to split by seed.")


def read_table(kind: str, split: str, path: Optional[str] = None, text_column: Optional[str] = None,
               label_column: Optional[str] = None, validation_fraction: float = 0.1, split_seed: int = 0,
               user_column: Optional[str] = None, **_options) -> list[dict[str, Any]]:
    split = canonical_split(split)
    source = existing_path(path, kind)
    if source.is_dir():
        return read_table_file(_split_file(source, split, kind), text_column, label_column, user_column)
    records = read_table_file(source, text_column, label_column, user_column)
    # A row's place in the file is its identity for the seeded split; with users, the user is (held-out users)
    row_number = {id(record): str(number) for number, record in enumerate(records)}
    divide = user_split if user_column is not None else seeded_split
    return divide(records, split, lambda r: row_number[id(r)], validation_fraction, split_seed)


def read_jsonl(split: str, path: Optional[str] = None, **options) -> list[dict[str, Any]]:
    return read_table("jsonl", split, path, **options)


def read_csv(split: str, path: Optional[str] = None, **options) -> list[dict[str, Any]]:
    return read_table("csv", split, path, **options)


def read_tsv(split: str, path: Optional[str] = None, **options) -> list[dict[str, Any]]:
    return read_table("tsv", split, path, **options)
