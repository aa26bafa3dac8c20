"""One rank of a test's process group: ``python rank_entry.py SCRIPT OUT`` runs SCRIPT as ``__main__`` with argv
``[SCRIPT, OUT]``, then ends the process past the interpreter's teardown, as ``dptext``'s own ranks do
(dptext.cli.app.run_as_rank): gloo's threads can abort a finished rank there ("terminate called without an active
exception"), which failed CI's fixtures now and then after every rank had saved its results."""

from __future__ import annotations

import os
import runpy
import sys

from dptext.cli.app import run_as_rank

if __name__ == "__main__":
    script, out = sys.argv[1], sys.argv[2]
    sys.argv = [script, out]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` would have it
    run_as_rank(lambda: runpy.run_path(script, run_name="__main__"))
