"""The two field builders every recipe section uses: a documented, constrained leaf and a nested section."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def doc(default: Any, text: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
        lt: float | None = None, excludes: str | None = None, only_with: tuple[str, Any] | None = None) -> Any:
    """A dataclass field with a default, its user-facing documentation and its declared constraints.

    ``ge``/``gt``/``le``/``lt`` bound a number (checked on load, shown by `dptext check --schema`); ``excludes``
    names a key that must not also be set (the two are alternatives); ``only_with=(key, value)`` says a
    non-default value only means something when ``key`` has ``value``. Declared here, once, so every key added
    later is checked the same way (see ``dptext.constraints``).
    """
    metadata = {"doc": text, "bounds": (ge, gt, le, lt), "excludes": excludes, "only_with": only_with}
    if isinstance(default, (list, dict)):
        factory = (lambda d: (lambda: type(d)(d)))(default)
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def section(cls: type, text: str) -> Any:
    """A recipe section: a nested schema dataclass, defaulting to its own defaults."""
    return field(default_factory=cls, metadata={"doc": text})
