"""Checks on local paths, so a wrong ``data.path`` is one clear sentence, not a traceback."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from dptext.errors import UserError
from dptext.textfiles import relative_note


def existing_path(path: Optional[str], dataset: str) -> Path:
    if path is None:
        raise UserError(f"The {dataset} reader needs local files; pass data.path= (or --path) pointing to them.")
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise UserError(f"The {dataset} data path {resolved} does not exist{relative_note(resolved)}; check "
                        "data.path (or --path).")
    return resolved


def data_folder(path: Optional[str], dataset: str, expected: str) -> Path:
    """A folder that holds the dataset's files; ``expected`` names them for the error message."""
    folder = existing_path(path, dataset)
    if not folder.is_dir():
        raise UserError(f"The {dataset} data path {folder} is a file; pass the folder that holds {expected}.")
    return folder


def file_in(folder: Path, name: str, dataset: str) -> Path:
    candidate = folder / name
    if not candidate.is_file():
        present = ", ".join(sorted(p.name for p in folder.iterdir())[:12]) or "nothing"
        raise UserError(f"The {dataset} file {candidate} is missing (the folder holds {present}); check data.path.")
    return candidate


@contextmanager
def gc_paused():
    """Pause the cyclic garbage collector while a reader builds its records.

    Readers create hundreds of thousands of small dicts and lists and no reference cycles;
    with the collector on, its repeated passes over them make reading about 3x slower.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
