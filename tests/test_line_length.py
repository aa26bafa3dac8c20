"""House style: no line of a tracked .py file is longer than 120 characters."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 120


def test_no_tracked_python_line_is_longer_than_the_limit():
    if shutil.which("git") is None:
        pytest.skip("git is not available")
    listing = subprocess.run(["git", "ls-files", "-z", "*.py"], cwd=ROOT, capture_output=True, text=True)
    if listing.returncode != 0:
        pytest.skip(f"{ROOT} is not a git checkout")
    too_long = [f"{name}:{number} ({len(line)} characters)"
                for name in listing.stdout.split("\0") if name and (ROOT / name).is_file()
                for number, line in enumerate((ROOT / name).read_text(encoding="utf-8").split("\n"), 1)
                if len(line) > LIMIT]
    assert not too_long, f"lines longer than {LIMIT} characters:\n" + "\n".join(too_long)
