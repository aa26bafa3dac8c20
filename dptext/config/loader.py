"""Strict loading: YAML or plain data to a checked ``Recipe`` (unknown keys, types, bounds, relations), and back."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from dptext.config.overrides import apply_overrides
from dptext.config.recipe import Recipe
from dptext.config.schema import _is_optional, _type_name, all_keys
from dptext.config.strict_yaml import DuplicateKey, load_unique
from dptext.constraints import check_relations, check_value
from dptext.errors import UserError
from dptext.textfiles import check_utf8


def _unknown_key_error(key: str, cls: type, prefix: str) -> UserError:
    valid = all_keys(Recipe)
    full = prefix + key
    close = difflib.get_close_matches(full, valid, n=1, cutoff=0.5)
    if not close:  # a misspelt leaf under the right section, e.g. 'privacy.epsilon'
        leaves = [k for k in valid if k.rsplit(".", 1)[-1] == key or key in k]
        close = leaves[:1]
    hint = f"; did you mean '{close[0]}'?" if close else "; valid keys are listed by `dptext check --schema`."
    return UserError(f"Unknown recipe key '{full}'{hint}")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    optional, inner = _is_optional(tp)
    if value is None or (value == "" and inner is not str):
        if optional:
            return None
        raise UserError(f"Recipe key '{key}' cannot be empty; give a {_type_name(tp)}.")
    if typing.get_origin(inner) is Literal:
        choices = typing.get_args(inner)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise UserError(f"Recipe key '{key}' is '{value}' but must be {_type_name(inner)}{hint}.")
        return value
    if inner is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in {"true", "false", "yes", "no"}:
            return value.lower() in {"true", "yes"}
    elif inner is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif inner is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads '1e-5' as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif inner is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif inner is list or typing.get_origin(inner) is list:
        if isinstance(value, list):
            return value
    elif inner is dict or typing.get_origin(inner) is dict:
        if isinstance(value, dict):
            return value
    else:  # pragma: no cover - a schema field of a type this loader does not know
        raise TypeError(f"unsupported schema type {tp!r} for {key}")
    raise UserError(f"Recipe key '{key}' is {value!r} but must be {_type_name(tp)}.")


def from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    """Build a schema dataclass from plain data, strictly."""
    if not isinstance(data, dict):
        raise UserError(f"Recipe section '{prefix.rstrip('.') or 'top level'}' must be a mapping of keys to values.")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key_error(str(key), cls, prefix)
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(tp, value if value is not None else {}, prefix + key + ".")
            continue
        kwargs[key] = _coerce(value, tp, prefix + key)
        if kwargs[key] == "" and fields[key].default not in ("", None):  # a name, a path: empty means nothing
            raise UserError(f"Recipe key '{prefix + key}' cannot be empty; give a {_type_name(tp)} "
                            f"(default: {fields[key].default}).")
        check_value(prefix + key, kwargs[key], fields[key].metadata)
    return cls(**kwargs)


def given_keys(data: Any, prefix: str = "") -> set[str]:
    """The dotted keys a recipe's raw data sets (sections recursed), e.g. {'privacy.target_epsilon'}."""
    keys: set[str] = set()
    for key, value in (data or {}).items() if isinstance(data, dict) else []:
        keys.add(prefix + str(key))
        if isinstance(value, dict):
            keys |= given_keys(value, prefix + str(key) + ".")
    return keys


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe (or start from the defaults when path is None), apply overrides, validate."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise UserError(f"Recipe '{path}' is a folder; pass a recipe file (shipped recipes are in recipes/).")
        if not path.is_file():
            raise UserError(f"Recipe file '{path}' does not exist; check the path (shipped recipes are in recipes/).")
        check_utf8(path, "recipe")  # a Latin-1 byte, UTF-16, gzip: named in one sentence, never a traceback
        try:
            data = load_unique(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise UserError(f"Recipe '{path}' is not valid YAML{where}; fix the syntax and retry.") from exc
        except DuplicateKey as exc:
            raise UserError(f"Recipe '{path}' gives '{exc.key}' twice (lines {exc.first_line} and {exc.line}) and "
                            "YAML would silently keep only the last; merge them into one.") from None
        if data is None or data == {}:  # the defaults alone train nothing anyone chose
            raise UserError(f"Recipe '{path}' is empty; start from a shipped one (e.g. recipes/quickstart.yaml) "
                            "and change what you need.")
        if not isinstance(data, dict):
            raise UserError(f"Recipe '{path}' must be a YAML mapping of sections (model:, data:, ...).")
        data.setdefault("name", path.stem)
    data = apply_overrides(data, overrides or [])
    recipe = from_dict(Recipe, data)
    check_relations(recipe, given_keys(data))
    return recipe


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(to_dict(recipe), sort_keys=False, allow_unicode=True)
