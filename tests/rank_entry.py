"""One rank of a test's process group: ``python rank_entry.py SCRIPT OUT`` runs SCRIPT as ``__main__`` with argv
``[SCRIPT, OUT]``, then ends the process past the interpreter's teardown, as ``dptext``'s own ranks do
(dptext.cli.app._leave_rank): gloo's threads can abort a finished rank there ("terminate called without an active
exception"), which failed CI's fixtures now and then after every rank had saved its results."""

from __future__ import annotations

import os
import runpy
import sys
import traceback

if __name__ == "__main__":
    script, out = sys.argv[1], sys.argv[2]
    sys.argv = [script, out]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` would have it
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
