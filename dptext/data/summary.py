"""What ``dptext data`` shows: per-split record counts, label histograms, text lengths, empty texts, examples per
user when a user column is given (counts only), and the first records of a split (without their user id).

A plain function so that tests and other commands can call it; the CLI only renders it.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from typing import Any, Optional

from dptext.data import dataset_info, load_split
from dptext.data.splits import SPLITS, canonical_split
from dptext.data.users import USER, user_statistics
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
    stats: dict[str, dict[str, Any]] = {}
    users: dict[str, dict[str, Any]] = {}
    with_users = options.get("user_column") not in (None, "")
    errors: dict[str, str] = {}
    examples: list[dict] = []
    shown_split = None
    for name in wanted:
        try:
            # keep: records without a user are counted here, not refused (training refuses or drops them)
            records = load_split(info.name, name, path, missing_user="keep", **options)
        except UserError as exc:
            if split:
                raise
            counts[name], errors[name] = None, str(exc)
            continue
        counts[name] = len(records)
        stats[name] = split_statistics(records)
        if with_users:
            users[name] = user_statistics(records)
        if shown_split is None and records:  # the user id is never shown, even here (counts only)
            shown_split, examples = name, [{k: v for k, v in r.items() if k != USER} for r in records[: max(show, 0)]]
    if not any(count is not None for count in counts.values()):
        raise UserError(next(iter(errors.values())))
    return {"dataset": info.name, "path": path, "source": _source(info, path), "counts": counts, "statistics": stats,
            "users": users, "errors": errors,
            "shown_split": shown_split, "examples": examples}


TEXT_FIELDS = ("text", "ref", "response", "tokens")  # the text a record trains on, by reader family
LABEL_FIELDS = ("label", "intent", "rating")


def split_statistics(records: list[dict]) -> dict[str, Any]:
    """Label histogram, text length in words (min / median / max) and the number of empty texts of a split.

    Empty texts and stray labels are what own data gets wrong most; both are visible here before training.
    """
    field = next((f for f in TEXT_FIELDS if any(f in r for r in records)), None)
    lengths, empty = [], 0
    for record in records if field else []:
        value = record.get(field)
        words = len(value) if isinstance(value, list) else len(str(value or "").split())
        lengths.append(words)
        empty += words == 0
    label_field = next((f for f in LABEL_FIELDS if any(r.get(f) is not None for r in records)), None)
    histogram = Counter(str(r.get(label_field)) for r in records) if label_field else Counter()
    return {"text_field": field, "empty_texts": empty,
            "words": ({"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths)}
                      if lengths else None),
            "label_field": label_field, "labels": dict(sorted(histogram.items(), key=lambda kv: (-kv[1], kv[0])))}


def statistics_rows(stats: dict[str, dict[str, Any]], top: int = 8) -> list[list[Any]]:
    """One table row per split: text field, empty texts, words min/median/max, the most frequent labels."""
    rows = []
    for split, s in stats.items():
        words = s["words"]
        lengths = f"{words['min']} / {words['median']:g} / {words['max']}" if words else "-"
        labels = ", ".join(f"{k}: {v}" for k, v in list(s["labels"].items())[:top])
        if len(s["labels"]) > top:
            labels += f", … ({len(s['labels'])} in all)"
        rows.append([split, s["text_field"] or "-", s["empty_texts"], lengths,
                     f"{s['label_field']}: {labels}" if s["label_field"] else "-"])
    return rows


def user_rows(users: dict[str, dict[str, Any]]) -> tuple[list[list[Any]], list[list[Any]]]:
    """Two tables' rows: per split, users and examples per user; per split and bound k, users over k and
    Σ min(n_u, k) (how to choose k: docs/privacy_engine.md, "Privacy units")."""
    spread, bounds = [], []
    for split, u in users.items():
        per = u["per_user"]
        spread.append([split, f"{u['users']:,}", f"{u['examples']:,}", f"{u['missing_user']:,}",
                       f"{per['min']} / {per['median']:g} / {per['mean']:.2f} / {per['max']}" if per else "-"])
        for row in u["bounds"]:
            kept = row["examples_kept"] / u["examples"]
            bounds.append([split, row["k"], f"{row['users_over_k']:,}", f"{row['examples_kept']:,} ({kept:.1%})"])
    return spread, bounds


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
