"""Reading the text files a run, a recipe or a dataset is made of: UTF-8 only, every other byte named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dptext.errors import UserError


def read_lines(path: str | Path) -> list[str]:
    """The non-empty lines of a text file split at '\\n' only (a trailing '\\r' dropped).

    Not ``str.splitlines()``: that also splits at U+0085, U+2028 and other characters that JSON written with
    ``ensure_ascii=False`` keeps inside a string, tearing the record in two.
    """
    lines = Path(path).read_text(encoding="utf-8").split("\n")
    return [line.removesuffix("\r") for line in lines if line.strip()]


def visible_entries(folder: Path) -> list[str]:
    """A folder's entries but dot-names (atomic writes' temporary files and staging folders)."""
    return [p.name for p in folder.iterdir() if not p.name.startswith(".")] if folder.is_dir() else []


def read_json(path: Path, what: str) -> Any:
    """A JSON file a run wrote (None when absent); one sentence when it is cut short, edited or not UTF-8."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"'{path}' ({what}) is damaged ({exc}); restore it from a copy of the run directory, or "
                        "resume the run from a checkpoint to rewrite it.") from None

