"""Ctrl-C during a fine-tuning run, acted on where the run can act on it.

Python raises ``KeyboardInterrupt`` wherever the main thread is when SIGINT arrives. Inside a destructor (loading a
model frees many objects) Python prints "Exception ignored ... Traceback" and goes on, so a Ctrl-C while the model
loaded was lost and the run trained to the end with exit 0. So from the start of ``run_finetune`` to the end of its
training loop SIGINT only raises a flag (``StopRequest``), and the run looks at it where it controls what is on
disk: once the model has loaded (nothing trained: an unstarted run folder is removed, and ``--resume`` is suggested
only when a checkpoint exists) and after every step (the step is kept and checkpointed). A second Ctrl-C raises
``KeyboardInterrupt`` at once; if a destructor swallows that one too, the flag still stops the run at the next check.

Not under torchrun: ranks would stop at different steps and wait for each other forever (Ctrl-C ends them at once).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any, Iterator

from dptext.errors import RunInterrupted, RunStopped

NOTICE = (b"\nCtrl-C: stopping at the next safe point (once the model has loaded, or after the current step); "
          b"press it again to stop at once.\n")


class StopRequest:
    """Whether Ctrl-C was pressed; ``run``: the run folder it concerns, once there is one (for the hint)."""

    def __init__(self) -> None:
        self.requested = False
        self.run: Any = None


_active: StopRequest | None = None  # the request of the handler installed now (one per process)


@contextlib.contextmanager
def ctrl_c_deferred(enabled: bool = True) -> Iterator[StopRequest]:
    """SIGINT sets the yielded request's flag instead of raising (the second one raises); a nested use (the loop
    inside ``run_finetune``) shares the outer request, so a Ctrl-C before the loop is seen by it."""
    global _active
    if _active is not None:
        yield _active
        return
    request = StopRequest()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield request
        return

    def on_sigint(signum: int, frame: Any) -> None:
        if request.requested:
            raise KeyboardInterrupt
        request.requested = True
        os.write(2, NOTICE)  # not print(): a handler may run in the middle of another write to sys.stderr

    previous = signal.signal(signal.SIGINT, on_sigint)
    _active = request
    try:
        yield request
    finally:
        _active = None
        signal.signal(signal.SIGINT, previous)


def stop_if_requested_before_training(request: StopRequest, run: Any, resumed: bool, keep_folder: bool) -> None:
    """The check once the model has loaded: nothing was trained by this invocation, so a new run's folder is taken
    back (as for a failed start), and a resumed run keeps its checkpoints untouched."""
    if not request.requested:
        return
    if not resumed:
        run.remove_unstarted(keep_folder=keep_folder)
    raise RunInterrupted(run.path, None, resumable=resumed and run.latest_checkpoint() is not None)


def stopped_at_once(error: KeyboardInterrupt, request: StopRequest) -> BaseException:
    """A ``KeyboardInterrupt`` raised by a second Ctrl-C, as a ``RunStopped`` that says whether a checkpoint can
    resume the run; any other (a test's simulated kill, torchrun's Ctrl-C) as it is."""
    run = request.run
    if not request.requested or run is None:
        return error
    return RunStopped(run.path, resumable=run.path.is_dir() and run.latest_checkpoint() is not None)
