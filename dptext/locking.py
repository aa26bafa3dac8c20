"""One writer per folder: an advisory lock on the run or synth folder itself, held while a command writes it.

Two ``finetune --out o`` started together, two ``--resume`` of one run, or a ``--resume`` while the run still
trains would interleave their metrics and overwrite each other's model; the second writer is refused instead.
The lock is ``flock`` on the folder's own descriptor: the kernel drops it when the process exits or crashes, so a
killed run never leaves a stale lock, and no lock file is added to a folder whose release.json lists every file.
The holder's pid, for the refusal, comes from /proc/locks.

Held until ``release_all`` (the CLI calls it when a command ends) or the process exits; taking a lock this process
already holds is a no-op, so library code may take it at every entry point (``RunDir.create``, resume, synth, mia).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from dptext.errors import UserError

_held: dict[str, int] = {}  # resolved folder -> the open descriptor that holds its lock


def _holder(folder: Path) -> str:
    """The pid holding a flock on ``folder`` according to /proc/locks ("unknown" where that is not readable)."""
    try:
        inode = os.stat(folder).st_ino
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if "FLOCK" in fields and fields[-3].split(":")[-1] == str(inode):
                return fields[-4]
    except (OSError, IndexError):
        pass
    return "unknown"


def _refusal(folder: Path, what: str) -> UserError:
    return UserError(f"The {what} '{folder}' is being written by another dptext process (pid {_holder(folder)}); "
                     "wait for it to finish or stop it, then try again.")


def _try_lock(folder: Path, mode: int) -> int | None:
    """An open descriptor of ``folder`` holding the lock, or None when another process holds it."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: another open descriptor holds it
        os.close(fd)
        return None
    return fd


def holds_lock(folder: str | Path) -> bool:
    return str(Path(folder).resolve()) in _held


def check_unlocked(folder: str | Path, what: str = "run folder") -> None:
    """Refuse, writing nothing, when another process holds ``folder``'s lock (checks before a run writes)."""
    folder = Path(folder)
    if holds_lock(folder) or not folder.is_dir():
        return
    fd = _try_lock(folder, fcntl.LOCK_SH)
    if fd is None:
        raise _refusal(folder, what)
    os.close(fd)  # closing drops the shared lock just taken


def lock_folder(folder: str | Path, what: str = "run folder") -> None:
    """Take the exclusive lock on ``folder`` (created if missing) or refuse in one sentence naming the holder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if holds_lock(folder):
        return
    fd = _try_lock(folder, fcntl.LOCK_EX)
    if fd is None:
        raise _refusal(folder, what)
    _held[str(folder.resolve())] = fd


def release(folder: str | Path) -> None:
    """Drop this process's lock on ``folder`` (before the folder is removed, so a re-created one is locked anew)."""
    fd = _held.pop(str(Path(folder).resolve()), None)
    if fd is not None:
        os.close(fd)


def release_all() -> None:
    """Drop every lock this process holds (the end of a command; exiting does the same)."""
    while _held:
        _, fd = _held.popitem()
        os.close(fd)
