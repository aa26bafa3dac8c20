"""Command-line overrides such as ``privacy.target_epsilon=3``: parsed as YAML values into the raw recipe data."""

from __future__ import annotations

from typing import Any

import yaml

from dptext.errors import UserError


def parse_override(text: str) -> tuple[list[str], Any]:
    """'privacy.target_epsilon=3' -> (['privacy', 'target_epsilon'], 3), values read as YAML."""
    if "=" not in text:
        raise UserError(f"Override '{text}' is not of the form key=value, e.g. privacy.target_epsilon=3.")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise UserError(f"Override '{text}' has no key; write it as key=value, e.g. train.epochs=1.")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for text in overrides or []:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise UserError(f"Override '{text}' descends into '{part}', which is a value, not a section.")
            node = child
        node[path[-1]] = value
    return data
