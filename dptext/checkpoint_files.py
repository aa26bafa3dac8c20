"""Checkpoints a resume can trust: each ``step-N.pt`` carries a SHA-256 in ``step-N.pt.sha256``, and a resume takes
the newest one that verifies.

A checkpoint cut short (a full disk, a copy interrupted), overwritten with other bytes, or a ``LATEST`` that names a
file no longer there never crashes a resume and never makes it restart from step 0 while valid checkpoints remain:
the newest intact one is used and the skipped ones are named. When checkpoints exist and none verifies, the resume
is refused in one sentence. Checkpoints written before the checksums existed are tried by loading them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, BinaryIO, Callable

from dptext.errors import UserError

SUFFIX = ".sha256"


class HashingWriter:
    """A binary file wrapper that hashes what passes through ``write`` (torch.save writes a stream, no seeks)."""

    def __init__(self, handle: BinaryIO):
        self.handle, self.sha = handle, hashlib.sha256()

    def write(self, data: Any) -> int:
        self.sha.update(data)
        return self.handle.write(data)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, ...: the file's own
        return getattr(self.handle, name)


def file_digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def checksum_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + SUFFIX)


def candidates(folder: Path, latest: str | None) -> list[Path]:
    """The checkpoints to try, newest first: LATEST's, then every ``step-*.pt`` by step."""
    steps = sorted(folder.glob("step-*.pt"), reverse=True) if folder.is_dir() else []
    first = [folder / latest] if latest and (folder / latest) in steps else []
    return first + [p for p in steps if p not in first]


def _problem(path: Path, load: Callable[[Path], Any]) -> tuple[Any, str | None]:
    """(state, None) for a checkpoint that verifies and loads, else (None, what is wrong with it)."""
    stored = checksum_path(path)
    if stored.is_file():
        expected = stored.read_text(encoding="ascii", errors="replace").strip()
        if file_digest(path) != expected:
            return None, "its checksum does not match (cut short or overwritten)"
    try:
        return load(path), None
    except Exception as exc:  # unpickling, a truncated zip, random bytes: any of these means "not usable"
        return None, f"it cannot be read ({type(exc).__name__})"


def load_newest_valid(folder: Path, latest: str | None, load: Callable[[Path], Any],
                      say: Callable[[str], None] | None = None) -> Any:
    """The state of the newest checkpoint that verifies; None when the run has no checkpoint (and LATEST names
    none). ``latest``: the name LATEST holds (None without LATEST); ``say`` hears which checkpoints were skipped."""
    tried = candidates(folder, latest)
    if not tried:
        if latest:
            raise UserError(f"{folder / 'LATEST'} names {latest}, which is missing, and no other checkpoint is "
                            "there, so the run cannot continue where it stopped; restore the checkpoints folder "
                            "or start a new run.")
        return None
    skipped = [] if not latest or (folder / latest).exists() else [f"{latest} (named by LATEST) is missing"]
    for path in tried:
        state, problem = _problem(path, load)
        if problem is None:
            if skipped and say is not None:
                say(f"Resuming from {path.name}, the newest intact checkpoint: {'; '.join(skipped)}.")
            return state
        skipped.append(f"{path.name}: {problem}")
    raise UserError(f"No checkpoint in {folder} can be used ({'; '.join(skipped)}); restore an intact copy of "
                    "the run directory or start a new run.")
