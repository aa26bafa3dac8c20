"""The recipe's declared constraints: number ranges, alternatives, keys that need another key's value.

Each schema field declares its constraints once, in its ``doc(...)`` metadata (``dptext.config``); this
module reads them generically, so a key added later is range-checked, shown by `dptext check --schema`
and walked by the fuzz test without anyone writing another ``if``. Everything here is pure: no data,
no models, no disk.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

from dptext.errors import UserError

# data.dataset inferred from data.path's extension when a recipe names a file but no reader
GENERIC_READERS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".tsv": "tsv"}
DEFAULT_DATASET = "e2e"  # what a recipe with neither data.dataset nor data.path reads (the hub)


def bounds_text(metadata: Any) -> str:
    """'> 0', 'in [0, 1)', '≥ 1' ... for `dptext check --schema`; '' for an unbounded key."""
    ge, gt, le, lt = metadata.get("bounds", (None, None, None, None))
    low = f"[{ge:g}" if ge is not None else f"({gt:g}" if gt is not None else None
    high = f"{le:g}]" if le is not None else f"{lt:g})" if lt is not None else None
    if low and high:
        text = f"in {low}, {high}"
    elif low:
        text = f"≥ {ge:g}" if ge is not None else f"> {gt:g}"
    elif high:
        text = f"≤ {le:g}" if le is not None else f"< {lt:g}"
    else:
        text = ""
    extra = []
    if metadata.get("excludes"):
        extra.append(f"not with {metadata['excludes']}")
    if metadata.get("only_with"):
        key, value = metadata["only_with"]
        extra.append(f"only with {key}={value}")
    return "; ".join([t for t in [text] + extra if t])


def check_value(key: str, value: Any, metadata: Any) -> None:
    """Refuse a non-finite float or a number outside the field's declared range, naming the key."""
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"Recipe key '{key}' is {value} but must be a finite number; give a value "
                        f"{bounds_text(metadata) or 'such as 1.0'}.")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    ge, gt, le, lt = metadata.get("bounds", (None, None, None, None))
    if ((ge is not None and value < ge) or (gt is not None and value <= gt)
            or (le is not None and value > le) or (lt is not None and value >= lt)):
        raise UserError(f"Recipe key '{key}' is {value:g} but must be {bounds_text({'bounds': (ge, gt, le, lt)})}; "
                        "change it (`dptext check --schema` lists every key's range).")


def leaf_fields(obj: Any, prefix: str = ""):
    """(dotted key, owning dataclass instance, field) for every leaf of a resolved recipe."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from leaf_fields(value, prefix + f.name + ".")
        else:
            yield prefix + f.name, obj, f


def get_key(recipe: Any, key: str) -> Any:
    node = recipe
    for part in key.split("."):
        node = getattr(node, part)
    return node


def set_key(recipe: Any, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    node = recipe
    for part in parents:
        node = getattr(node, part)
    setattr(node, last, value)


def check_relations(recipe: Any, given: set[str]) -> None:
    """Alternatives and dependent keys, across sections; fills data.dataset when it can be inferred.

    ``given`` holds the dotted keys the recipe file or the overrides set. An alternative left at its default
    yields to one that was given (a pinned σ clears the default target ε, so the resolved recipe says which
    one runs); two given alternatives are refused, since one of them would be silently ignored.
    """
    for key, owner, f in list(leaf_fields(recipe)):
        value = getattr(owner, f.name)
        other = f.metadata.get("excludes")
        if other and value is not None and get_key(recipe, other) is not None:
            if other in given:
                raise UserError(f"Recipe keys '{key}' and '{other}' are alternatives but both are set; keep one "
                                f"(e.g. add {other}=null to the overrides).")
            set_key(recipe, other, None)
        needs = f.metadata.get("only_with")
        if needs and value != f.default and get_key(recipe, needs[0]) != needs[1]:
            raise UserError(f"Recipe key '{key}={value}' applies only with {needs[0]}={needs[1]}; set "
                            f"{needs[0]}={needs[1]} or leave {key} at its default ({f.default}).")
    infer_dataset(recipe.data)


def infer_dataset(data: Any) -> None:
    """data.dataset from data.path when it is empty: a generic reader named by the file's extension (and
    ``~`` in data.path expanded, as a shell would, so resolved.yaml names the folder that was read)."""
    if isinstance(data.path, str) and data.path.startswith("~"):
        data.path = os.path.expanduser(data.path)
    if data.dataset not in (None, ""):
        return
    if data.path in (None, ""):
        data.dataset = DEFAULT_DATASET
        return
    path = Path(data.path)
    reader = GENERIC_READERS.get(path.suffix.lower())
    if reader is None and path.is_dir():  # a folder: e2e's release folder, or one generic format throughout
        suffixes = {p.suffix.lower() for p in path.iterdir() if p.suffix.lower() in GENERIC_READERS}
        readers = {GENERIC_READERS[s] for s in suffixes}
        reader = (DEFAULT_DATASET if (path / "trainset.csv").is_file()
                  else (readers.pop() if len(readers) == 1 else None))
    if reader is None and not path.exists():  # refused later by the data check, which names the missing path
        reader = DEFAULT_DATASET
    if reader is None:
        raise UserError(f"data.path '{data.path}' is set but data.dataset is not, and its reader cannot be told "
                        "from the name; set data.dataset (jsonl, csv, tsv for your own files; "
                        "`dptext data` lists all).")
    data.dataset = reader
