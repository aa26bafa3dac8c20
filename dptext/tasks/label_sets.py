"""Declared label sets: classes, intents, slot tags and control-code values are public inputs.

A label set read off the private training records publishes every label that occurs, also one that a single
record carries: in the shape of a saved head, in ``config.json``, in ``intent_slot_labels.json``, in the codes
of synthetic data. So the sets come from the recipe (``task.labels``, ``task.intents``, ``task.slot_types``,
``task.code_domain``, taken from the dataset's documentation) or from a dataset's published label names, and a
training record outside them is refused before training, by its position and never by its value (the message
must not print a private label), or mapped to ``task.other_label`` when the recipe asks for that.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from dptext.errors import UserError



def refuse_outside(position: int, what: str, key: str, split: str = "train", source: Optional[str] = None
                   ) -> UserError:
    # by position in the split, which `dptext data` lists in the same order (a file split by seed has no line)
    name = "Training" if split == "train" else split.capitalize()
    article = "an" if what[0] in "aeiou" else "a"
    of = f" of '{source}'" if source else ""
    return UserError(f"{name} record {position + 1}{of} (counting from 1 in the order `dptext data --split {split}` "
                     f"lists them) has {article} {what} outside the declared set ({key}); add the value to {key} "
                     "if it is public, set task.other_label to map such records to a declared class, or fix the "
                     "record.")


def declared_classes(recipe: Any, published: Optional[Sequence[str]]) -> list:
    """Classification classes in label order: ``task.labels``, else the dataset's published label names."""
    if recipe.task.labels:
        classes = list(recipe.task.labels)
    elif published:
        classes = list(published)
    else:
        raise UserError(f"data.dataset={recipe.data.dataset} has no published label set; declare the classes in "
                        "label order as task.labels (e.g. task.labels=[negative, positive]), from the data's "
                        "documentation, not from its records.")
    if len({str(c) for c in classes}) != len(classes):
        raise UserError("task.labels lists a class twice; give each class once, in label order.")
    return classes


def class_index(value: Any, classes: Sequence[Any]) -> Optional[int]:
    """Position of ``value`` among ``classes``: a declared value itself ("positive", a rating 4), or an integer
    index into the list (GLUE's 0/1); None when it is neither."""
    names = [str(c) for c in classes]
    if value is not None and str(value) in names:
        return names.index(str(value))
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(classes):
        return value
    return None


def other_index(recipe: Any, names: Sequence[Any], key: str) -> Optional[int]:
    """Index of ``task.other_label`` in ``names`` (None when the recipe does not ask for an "other" class)."""
    other = recipe.task.other_label
    if other is None:
        return None
    index = class_index(other, names)
    if index is None:
        raise UserError(f"task.other_label={other!r} is not in {key}; declare it there too.")
    return index


def check_records(records: Sequence[dict[str, Any]], known: Callable[[dict[str, Any]], bool], mapped: bool,
                  what: str, key: str, split: str = "train", source: Optional[str] = None) -> None:
    """Refuse (by position) the first record of ``split`` that ``known`` rejects, unless an "other" class
    catches it."""
    if mapped:
        return
    for position, record in enumerate(records):
        if not known(record):
            raise refuse_outside(position, what, key, split, source)


def bio_tags(slot_types: Sequence[str]) -> list[str]:
    """O, then B-<type> and I-<type> for every declared slot type."""
    return ["O"] + [f"{prefix}-{slot}" for slot in slot_types for prefix in ("B", "I")]


def declared_intents_and_tags(recipe: Any) -> tuple[list[str], list[str]]:
    task = recipe.task
    if not task.intents or not task.slot_types:
        raise UserError("intent_slot needs its label sets declared: task.intents and task.slot_types, from the "
                        "dataset's documentation (the shipped recipes/atis-*.yaml and snips-*.yaml list them).")
    return [str(i) for i in task.intents], bio_tags([str(s) for s in task.slot_types])


def canonical(value: Any) -> str:
    """A code value as compared with the declared domain: text, with whole numbers written as such (5.0 == 5)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def check_code_domain(records: Sequence[dict[str, Any]], fields: Sequence[str], domain: dict[str, list]) -> None:
    """The declared domain lists each value once, and every training record's control code lies in it (refused by
    position)."""
    for name in fields:  # a value listed twice (4 and 4.0 alike) is two histogram cells one record counts in
        seen = [canonical(v) for v in domain.get(name, [])]
        twice = sorted({v for v in seen if seen.count(v) > 1})
        if twice:
            raise UserError(f"The code domain lists {name} value(s) {twice} more than once, so one record would be "
                            "counted in several histogram cells and its noise would not cover it; list each value "
                            "once in task.code_domain (or --code-domain).")
    values = {f: {canonical(v) for v in domain.get(f, [])} for f in fields}
    missing = [f for f in fields if not values[f]]
    if missing:
        raise UserError(f"The code domain lists no values for {missing}; declare every code field's values in "
                        "task.code_domain (or --code-domain).")
    for position, record in enumerate(records):
        if any(canonical(record.get(f)) not in values[f] for f in fields):
            raise refuse_outside(position, "control code", "task.code_domain")
