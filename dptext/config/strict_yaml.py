"""YAML for recipes: like ``yaml.safe_load``, but a key given twice in one mapping is an error.

PyYAML keeps the last of two equal keys silently, so a recipe with two ``train:`` sections would train with the
second and ignore the first: a run that differs from the file a reader sees. Refused instead, naming both lines.
"""

from __future__ import annotations

from typing import Any

import yaml


class DuplicateKey(Exception):
    def __init__(self, key: Any, first_line: int, line: int):
        super().__init__(key)
        self.key, self.first_line, self.line = key, first_line, line


class _UniqueKeyLoader(yaml.SafeLoader):
    pass


def _mapping_without_duplicates(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue  # only plain keys can be compared; YAML merge keys (<<) are not duplicates
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise DuplicateKey(key, seen[key], line)
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def load_unique(text: str) -> Any:
    """``yaml.safe_load`` that raises ``DuplicateKey`` for a key given twice in one mapping."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
