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

from dptext.data import dataset_info, label_names, load_records
from dptext.errors import UserError
from dptext.finetune.baseline import check_baseline
from dptext.data.users import user_groups
from dptext.finetune.user_level import check_user_level, user_level
from dptext.model_check import check_model_name
from dptext.locking import check_unlocked
from dptext.textfiles import relative_note
from dptext.runs import RunDir, visible_entries
from dptext.tasks.label_sets import check_records as check_declared
from dptext.tasks.label_sets import class_index, declared_classes, declared_intents_and_tags, other_index

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
        check_unlocked(out)
        if visible_entries(out) and not RunDir(out).reusable():
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
        raise UserError(f"data.path '{data.path}' does not exist{relative_note(data.path)}; pass an existing "
                        f"file or folder for the {info.name} reader.")
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
        if data.path and _overlapping_paths(Path(privacy.edp_public_path), Path(data.path)):
            # its train split is the private training data: α would be first_step's, labelled as covered
            raise UserError(f"privacy.edp_public_path '{privacy.edp_public_path}' is (or lies within) the private "
                            f"training data '{data.path}', so α would be measured on private examples; point it at "
                            "public examples, or say so with edp_scaling=first_step (not covered by ε).")


def _overlapping_paths(first: Path, second: Path) -> bool:
    """Whether one path is the other or lies inside it (after resolving links)."""
    a, b = first.resolve(), second.resolve()
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def check_privacy(recipe: Any) -> None:
    privacy = recipe.privacy
    if privacy.enabled and privacy.target_epsilon is None and privacy.noise_multiplier is None:
        raise UserError("Set privacy.target_epsilon (or privacy.noise_multiplier), or privacy.enabled=false "
                        "for a non-private baseline.")
    check_user_level(recipe)


def validate_run(recipe: Any, out: str | Path | None = None, check_out: bool = True, check_model: bool = True) -> None:
    """Refuse a run that cannot start, before it loads data or weights or writes anything."""
    check_privacy(recipe)
    check_data(recipe)
    check_baseline(recipe)
    if check_model:  # `dptext distill` names its models in the distill section and checks them itself
        check_model_name(recipe.model.name)
    if check_out:
        check_output_dir(out)


def check_records(recipe: Any, splits: dict[str, list]) -> None:
    """Bad data that would otherwise surface after training starts (or never): all-empty texts, and labels,
    intents or slot tags outside the declared sets (``dptext.tasks.label_sets``). A message names the split,
    the record's position and the field, never the record's content: the records are private data, and what a
    command prints ends up in logs and issue reports."""
    for split, records in splits.items():
        texts = [r.get("text") for r in records if isinstance(r, dict) and "text" in r]
        if texts and all(not str(t or "").strip() for t in texts):
            raise UserError(f"Every 'text' in the {split} split is empty; check data.text_column and the file.")
    task = recipe.task.type
    if task in LABELLED_TASKS:
        classes = declared_classes(recipe, label_names(recipe.data.dataset))
        mapped = other_index(recipe, classes, "task.labels") is not None
        checks = [(lambda r: r.get("label") is None or class_index(r["label"], classes) is not None,
                   "label", "task.labels")]  # an unlabelled split (GLUE test) is the task's to refuse
    elif task == "intent_slot":
        intents, tags = declared_intents_and_tags(recipe)
        mapped = other_index(recipe, intents, "task.intents") is not None
        intents, tags = set(intents), set(tags)
        checks = [(lambda r: r.get("intent") is None or r["intent"] in intents, "intent", "task.intents"),
                  (lambda r: all(t in tags for t in r.get("tags") or []), "slot tag", "task.slot_types")]
    else:
        return
    for split, records in splits.items():
        for known, what, key in checks:
            check_declared(records, known, mapped, what, key, split, recipe.data.path)


def copies_in_training(train: list, held_out: list) -> int:
    """How many held-out records have a word-for-word copy of their text in the training split: duplicated rows
    land on both sides of a seeded split, and the held-out metrics then measure memory, not new text."""
    seen = {r["text"] for r in train if isinstance(r, dict) and isinstance(r.get("text"), str)}
    return sum(1 for r in held_out if isinstance(r, dict) and isinstance(r.get("text"), str) and r["text"] in seen)


def validate_local_data(recipe: Any) -> None:
    """`dptext check`: read the training split when it is on this machine (never the hub) and check its records."""
    if recipe.data.path or dataset_info(recipe.data.dataset).offline:
        # own files (data.path) in full; a packaged corpus only its training split, which is what costs time
        names = ("train", "validation", recipe.eval.split) if recipe.data.path else ("train",)
        splits = {split: load_records(recipe.data, split) for split in dict.fromkeys(names)}
        if not splits["train"]:
            raise UserError("The training split is empty; check data.path and data.max_train_examples.")
        check_records(recipe, splits)
        if user_level(recipe):  # every training record names its user
            user_groups(splits["train"])
