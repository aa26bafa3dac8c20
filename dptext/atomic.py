"""Atomic writes: every file another step reads is written whole or not at all.

A file is written to a temporary name in its own folder, flushed, fsynced and renamed over the target
(``atomic_write``; ``atomic_directory`` does the same for a folder such as a saved model), so a crash, Ctrl-C or a
full disk (one sentence, ``dptext.errors.no_space_error``) leaves the old file or the new one, never a torn one.
Append-only logs (``append_json_line``) are fsynced per line and cut back to the last whole line on a failed write.
Only files registered in ``dptext.release`` may be written into a folder that has a ``release.json``, and that
manifest is rewritten after each file (``write_manifest``). ``dptext.runs`` lays out a run directory with these;
synth folders, audits and benchmarks use them directly (through ``dptext.runs``, which re-exports them).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from dptext import release
from dptext.errors import is_no_space, no_space_error
from dptext.output import _jsonable


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def append_json_line(path: str | Path, record: Any) -> None:
    """Append ``record`` as one JSON line (a registered file); flushed and fsynced so a crash loses at most it."""
    release.check_registered(Path(path))
    with open(path, "a", encoding="utf-8") as handle:
        size = handle.tell()
        try:
            handle.write(json.dumps(_jsonable(record)) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        except OSError as exc:  # a full disk: no torn line for the next record to be glued to
            handle.truncate(size)
            if is_no_space(exc):
                raise no_space_error(path) from exc
            raise


def atomic_write(path: str | Path, write: Callable[[Any], None], binary: bool = False) -> None:
    """Write ``path`` via ``write(fileobj)`` on a temp file, then rename it into place."""
    path = Path(path)
    root = release.check_registered(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; results should read like any other file
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if is_no_space(exc):
            raise no_space_error(path) from exc
        raise
    if root is not None and path.name != release.MANIFEST:  # keep release.json in step with the folder
        write_manifest(root)


@contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    """Yield a staging folder next to ``target``; on success it replaces ``target`` in one rename.

    For outputs that are folders (a saved model): readers see the old folder or the complete new one.
    """
    target = Path(target)
    root = release.check_registered(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    os.chmod(staging, 0o777 & ~_umask())
    try:
        yield staging
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except Exception as exc:  # e.g. save_pretrained on a full disk
        if is_no_space(exc):
            raise no_space_error(target) from exc
        raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    if root is not None:
        write_manifest(root)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text))


def atomic_write_json(path: str | Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(_jsonable(data), indent=2) + "\n")


def write_manifest(root: str | Path, kind: str | None = None, flags: Any = None, unit: Any = None) -> dict[str, Any]:
    """(Re)write ``root/release.json``; kind, flags and privacy unit default to those of the manifest already there."""
    previous = release.read_manifest(root) or {}
    kind = kind or previous.get("kind", "run")
    flags = list(previous.get("flags", {})) if flags is None else list(flags)
    data = release.manifest(root, kind, flags, unit or previous.get("privacy_unit"))
    atomic_write_text(Path(root) / release.MANIFEST, json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return data
