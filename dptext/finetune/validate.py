"""Everything about a run that can be checked before anything is loaded or written.

``validate_run`` is what `dptext finetune` (and `dptext distill`) run first and what `dptext check` runs in
full: the recipe's types, ranges and alternatives are already checked on load (``dptext.config``, declared
once in the schema); this adds what needs the outside world but no model weights: the data reader and its
files, the model name (offline aliases, a local folder, or the hub's cache when the hub is unreachable), the
output directory, and the privacy settings a run needs. A mistake found here costs about a second and leaves
nothing on disk.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dptext.data import dataset_info, load_records
from dptext.errors import UserError
from dptext.model_check import check_model_name
from dptext.runs import RunDir

# objectives that read a class label from each record, and the readers whose records carry none
LABELLED_TASKS = ("classification", "infilling")
UNLABELLED_DATASETS = ("e2e", "dart", "chitchat", "personachat")
SEQUENCE_LABEL_DATASETS = ("atis", "snips")


def check_output_dir(out: str | Path | None) -> None:
    """--out must be a folder we can create (or an empty / never-started run folder) and write into."""
    if out is None:
        out = Path(os.environ.get("DPTEXT_RUNS_ROOT", "runs"))
    else:
        out = Path(out)
        if out.exists() and not out.is_dir():
            raise UserError(f"--out '{out}' is a file, not a folder; choose a folder path for the run directory.")
        if out.is_dir() and any(out.iterdir()) and not RunDir(out).reusable():
            raise UserError(f"Run directory '{out}' already exists and is not empty; "
                            f"pass --resume {out} to continue it or choose another --out.")
    existing = out
    while not existing.exists():  # the nearest folder that exists decides whether we may create the rest
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"Cannot create or write the run directory '{out}' ('{existing}' is not a writable "
                        "folder); choose another --out.")


def check_data(recipe: Any) -> None:
    data = recipe.data
    info = dataset_info(data.dataset)  # an unknown reader is named, with the closest one
    if data.path and not Path(data.path).exists():
        raise UserError(f"data.path '{data.path}' does not exist; pass an existing file or folder "
                        f"for the {info.name} reader.")
    task = recipe.task.type
    if task in LABELLED_TASKS and info.name in UNLABELLED_DATASETS:
        raise UserError(f"task.type={task} needs a class label per record but data.dataset={info.name} has none; "
                        "pick a labelled dataset (sst2, imdb, your own jsonl/csv with data.label_column).")
    if task == "intent_slot" and info.name not in SEQUENCE_LABEL_DATASETS + ("jsonl", "csv", "tsv"):
        raise UserError(f"task.type=intent_slot needs tokens, tags and an intent per record but data.dataset="
                        f"{info.name} has none; use data.dataset=atis or snips.")
    privacy = recipe.privacy
    if privacy.enabled and privacy.method == "edp_sgd" and privacy.edp_scaling == "public":
        if not privacy.edp_public_path or not Path(privacy.edp_public_path).exists():
            raise UserError("privacy.edp_scaling=public needs privacy.edp_public_path pointing to an existing file "
                            "or folder of public examples; set it, or use edp_scaling=uniform.")


def check_privacy(recipe: Any) -> None:
    privacy = recipe.privacy
    if privacy.enabled and privacy.target_epsilon is None and privacy.noise_multiplier is None:
        raise UserError("Set privacy.target_epsilon (or privacy.noise_multiplier), or privacy.enabled=false "
                        "for a non-private baseline.")


def validate_run(recipe: Any, out: str | Path | None = None, check_out: bool = True, check_model: bool = True) -> None:
    """Refuse a run that cannot start, before it loads data or weights or writes anything."""
    check_privacy(recipe)
    check_data(recipe)
    if check_model:  # `dptext distill` names its models in the distill section and checks them itself
        check_model_name(recipe.model.name)
    if check_out:
        check_output_dir(out)


def check_records(recipe: Any, splits: dict[str, list]) -> None:
    """Bad data that would otherwise surface after training starts (or never): all-empty texts, class ids
    that are negative, beyond the dataset's classes, or skip classes (a stray 7 in 0/1 data)."""
    for split, records in splits.items():
        texts = [r.get("text") for r in records if isinstance(r, dict) and "text" in r]
        if texts and all(not str(t or "").strip() for t in texts):
            raise UserError(f"Every 'text' in the {split} split is empty; check data.text_column and the file.")
    if recipe.task.type not in LABELLED_TASKS:
        return
    names = dataset_info(recipe.data.dataset).label_names
    seen: dict[int, str] = {}  # class id -> where it first occurs
    for split, records in splits.items():
        for number, record in enumerate(records, start=1):
            label = record.get("label") if isinstance(record, dict) else None
            if not isinstance(label, int) or isinstance(label, bool):
                continue  # missing or non-integer labels are the task's to map or refuse
            where = f"record {number} of the {split} split ({_snippet(record)})"
            if label < 0 or (names is not None and label >= len(names)):
                allowed = f"0..{len(names) - 1}" if names is not None else "0 or more"
                raise UserError(f"The {where} has label {label}, but class ids must be {allowed}; fix that "
                                "record (or data.label_column).")
            seen.setdefault(label, where)
    if names is None and seen:
        missing = sorted(set(range(max(seen) + 1)) - set(seen))
        if missing:
            top = max(seen)
            raise UserError(f"The {seen[top]} has label {top} but labels {_ranges(missing)} never occur, which "
                            f"would build a {top + 1}-class head; fix the stray label or number the classes 0..K-1.")


def _snippet(record: dict) -> str:
    text = " ".join(str(record.get("text", "")).split())
    return repr(text[:40] + ("…" if len(text) > 40 else ""))


def _ranges(ids: list[int]) -> str:
    return f"{ids[0]}–{ids[-1]}" if len(ids) > 2 and ids[-1] - ids[0] == len(ids) - 1 else ", ".join(map(str, ids))


def validate_local_data(recipe: Any) -> None:
    """`dptext check`: read the training split when it is on this machine (never the hub) and check its records."""
    if recipe.data.path or dataset_info(recipe.data.dataset).offline:
        # own files (data.path) in full; a packaged corpus only its training split, which is what costs time
        names = ("train", "validation", recipe.eval.split) if recipe.data.path else ("train",)
        splits = {split: load_records(recipe.data, split) for split in dict.fromkeys(names)}
        if not splits["train"]:
            raise UserError("The training split is empty; check data.path and data.max_train_examples.")
        check_records(recipe, splits)
