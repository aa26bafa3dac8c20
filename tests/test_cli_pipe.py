"""`dptext data ... | head`: a reader that stops early ends the command quietly with exit 0 (it exited 1 silently:
click turns the closed pipe into a bare exit 1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_closed_pipe_ends_dptext_data_quietly(tmp_path):
    data = tmp_path / "many.csv"  # far more than a pipe buffer (64 KiB) of output, so the write must fail
    data.write_text("text,label\n" + "".join(f"{'word ' * 30}{i},{i % 2}\n" for i in range(3000)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "300"}
    process = subprocess.Popen([sys.executable, "-m", "dptext", "data", "csv", "--path", str(data), "--show", "3000"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    assert process.stdout.readline()
    process.stdout.close()  # what `| head -1` does
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "error:" not in err
