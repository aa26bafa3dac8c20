"""Where a run came from: the dptext git revision, the versions of the packages that decide its numbers, the
command line and the machine (``provenance.json`` of a run directory, ``software`` of a synthetic data set)."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from dptext.allocator import setting as allocator_setting

TRACKED_PACKAGES = (
    "dptext", "torch", "transformers", "datasets", "numpy", "scipy", "prv-accountant", "dp-accounting",
    "typer", "rich", "sacrebleu", "rouge-score", "gguf", "peft", "opacus",
)


def git_revision(directory: Path | None = None) -> str:
    """The git commit of the dptext source tree (with '+dirty' when modified), or 'unknown'."""
    directory = directory or Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True, text=True, timeout=5)
        if rev.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=directory,
                               capture_output=True, text=True, timeout=5)
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def package_versions() -> dict[str, str]:
    found = {}
    for name in TRACKED_PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def accelerator() -> str | None:
    """The GPU a run computes on (name and CUDA version), None on a CPU-only machine: the same recipe's wall time
    differs by orders of magnitude between the two, so a result must say which it came from."""
    torch = sys.modules.get("torch")  # a run has loaded torch by now; a CLI listing never pays for it
    if torch is None or not torch.cuda.is_available():
        return None
    return f"{torch.cuda.get_device_name(torch.cuda.current_device())}, CUDA {torch.version.cuda}"


def provenance() -> dict[str, Any]:
    return {
        "git_revision": git_revision(),
        "packages": package_versions(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "accelerator": accelerator(),
        "command": sys.argv,
        "allocator": allocator_setting(),
        "started": _dt.datetime.now().isoformat(timespec="seconds"),
    }
