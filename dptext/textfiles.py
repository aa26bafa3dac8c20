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


MAGIC = {b"\x1f\x8b": "gzip-compressed data; decompress it (gunzip)",
         b"PK\x03\x04": "a zip archive; unpack it",
         b"\xff\xfe": "UTF-16 text; save it as UTF-8", b"\xfe\xff": "UTF-16 text; save it as UTF-8"}


def unreadable(path: Path, what: str, exc: OSError) -> UserError:
    """One sentence for a file that cannot be opened: a folder, no permission, a symlink loop."""
    reason = exc.strerror or type(exc).__name__
    return UserError(f"The {what} '{path}' cannot be read ({reason.lower()}); pass a readable file.")


def undecodable(path: Path, what: str) -> UserError:
    """One sentence for a file that is not UTF-8 text, naming what it is instead or the first bad byte's place."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        return unreadable(path, what, exc)
    kind = next((text for magic, text in MAGIC.items() if data.startswith(magic)), None)
    if kind is None and b"\x00" in data[:4096]:
        kind = "not plain text (it holds NUL bytes: UTF-16, or a binary file); save it as UTF-8 text"
    if kind is not None:
        return UserError(f"The {what} '{path}' is {kind}.")
    try:
        data.decode("utf-8")
        return UserError(f"The {what} '{path}' could not be decoded as UTF-8; save it as UTF-8 text.")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        return UserError(f"The {what} '{path}' is not UTF-8: byte 0x{data[exc.start]:02X} at line {line}, column "
                         f"{column} (Latin-1 or Windows-1252?); save it as UTF-8, e.g. "
                         f"`iconv -f latin1 -t utf-8 {path.name} > utf8-{path.name}`.")


def check_utf8(path: Path, what: str) -> None:
    """Refuse, in one sentence, a file that cannot be read or is not UTF-8 text (before a parser sees it)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise unreadable(path, what, exc) from None
    if any(data.startswith(magic) for magic in MAGIC) or b"\x00" in data[:4096]:
        raise undecodable(path, what)
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        raise undecodable(path, what) from None


def relative_note(path: str | Path) -> str:
    """For a path the user gave: where a relative one was looked for (the working directory, not the recipe's)."""
    return "" if Path(path).is_absolute() else f" (a relative path: it resolves against the working directory " \
        f"{Path.cwd()}, not the recipe's folder)"
