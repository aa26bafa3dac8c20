"""What ``dptext data`` shows: per-split record counts and the first records of a split.

A plain function so that tests and other commands can call it; the CLI only renders it.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from dptext.data import dataset_info, load_split
from dptext.data.splits import SPLITS, canonical_split
from dptext.errors import UserError


def summarize(dataset: str, path: Optional[str] = None, split: Optional[str] = None, show: int = 3,
              **options: Any) -> dict[str, Any]:
    """Counts for every split (or just ``split``) and the first ``show`` records of the first readable one.

    A split that cannot be read is reported with its error, unless it is the only one asked
    for or no split can be read at all: then the error is raised, as the user's data is unusable.
    """
    info = dataset_info(dataset)
    wanted = [canonical_split(split)] if split else list(SPLITS)
    counts: dict[str, Optional[int]] = {}
    errors: dict[str, str] = {}
    examples: list[dict] = []
    shown_split = None
    for name in wanted:
        try:
            records = load_split(info.name, name, path, **options)
        except UserError as exc:
            if split:
                raise
            counts[name], errors[name] = None, str(exc)
            continue
        counts[name] = len(records)
        if shown_split is None and records:
            shown_split, examples = name, records[: max(show, 0)]
    if not any(count is not None for count in counts.values()):
        raise UserError(next(iter(errors.values())))
    return {"dataset": info.name, "path": path, "source": _source(info, path), "counts": counts, "errors": errors,
            "shown_split": shown_split, "examples": examples}


def _source(info, path: Optional[str]) -> str:
    if path:
        return str(path)
    if info.offline:
        return "installed package"
    return f"Hugging Face hub: {info.hub_id}" if info.hub_id else "none"


def cell(value: Any, width: int = 60) -> str:
    """A record value as one short table cell: lists as compact JSON, long text cut with an ellipsis."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = " ".join(text.split())  # newlines inside references or reviews would break the table
    return text if len(text) <= width else text[: width - 1] + "…"


def example_table(examples: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Columns (the union of record keys, first-seen order) and shortened cells for a table."""
    columns: list[str] = []
    for record in examples:
        columns.extend(k for k in record if k not in columns)
    return columns, [[cell(record.get(c, "")) for c in columns] for record in examples]
