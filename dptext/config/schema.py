"""Reading the schema itself: type names, every dotted key, and the documented rows `dptext check --schema` prints."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

from dptext.config.recipe import Recipe
from dptext.constraints import bounds_text


def _is_optional(tp: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin in (Union, getattr(types, "UnionType", Union)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return True, args[0]
    return False, tp


def _type_name(tp: Any) -> str:
    optional, inner = _is_optional(tp)
    if typing.get_origin(inner) is Literal:
        name = "one of " + ", ".join(repr(a) for a in typing.get_args(inner))
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} or empty" if optional else name


def all_keys(cls: type = Recipe, prefix: str = "") -> list[str]:
    """Every valid dotted key of the schema, e.g. 'privacy.target_epsilon'."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        keys.append(key)
        if dataclasses.is_dataclass(hints[f.name]):
            keys.extend(all_keys(hints[f.name], key + "."))
    return keys


def schema_docs(cls: type = Recipe, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, doc) for every leaf field: the documented schema."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(schema_docs(tp, prefix + f.name + "."))
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        allowed = bounds_text(f.metadata)
        type_text = _type_name(tp) + (f", {allowed}" if allowed else "")
        rows.append((prefix + f.name, type_text, default, f.metadata.get("doc", "")))
    return rows
