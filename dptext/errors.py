"""The one exception type for mistakes a user can fix.

A ``UserError`` is rendered by the CLI as a single sentence (what is wrong and what to
do) with exit code 2 and no traceback; ``--debug`` shows the traceback. Library code
raises it for bad input (missing files, bad recipe values, impossible privacy targets)
and lets genuine bugs propagate as ordinary exceptions.
"""


class UserError(Exception):
    """A problem with the user's input, explained in one sentence with the fix."""


class RunInterrupted(Exception):
    """Ctrl-C stopped a training run cleanly at a point the run chose (``dptext.finetune.interrupts``): after a step,
    which was checkpointed, or (``step`` None) once the model had loaded, before this invocation trained.

    Not a ``KeyboardInterrupt``: Typer turns those into a silent exit 130, and this one must reach the CLI's
    error handler, which prints the ``--resume`` command when ``resumable`` (a checkpoint exists)."""

    def __init__(self, run_dir: object, step: int | None, resumable: bool = True, message: str | None = None):
        super().__init__(message or _interrupted(step, resumable))
        self.run_dir, self.step, self.resumable = run_dir, step, resumable


def _interrupted(step: int | None, resumable: bool) -> str:
    if step is not None:
        return f"interrupted after step {step} (checkpoint written)"
    if resumable:
        return "interrupted before training resumed (the run's checkpoints are as they were)"
    return ("interrupted before the first training step, so nothing was trained or kept (a new run's folder is "
            "removed); start the run again")


class RunStopped(RunInterrupted):
    """A second Ctrl-C stopped a training run at once, mid-step; ``resumable``: a checkpoint can continue it."""

    def __init__(self, run_dir: object, resumable: bool):
        super().__init__(run_dir, None, resumable, "stopped at once by a second Ctrl-C" + (
            " (the steps since the last checkpoint are lost)" if resumable else
            "; no checkpoint was written, so nothing can be resumed"))


NO_SPACE_ERRNOS = (28, 122)  # ENOSPC, EDQUOT (a full disk or a spent quota)


def is_no_space(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) is a full disk: an OSError ENOSPC/EDQUOT, or torch's zip writer failing
    mid-file ("[enforce fail at inline_container.cc] ... file write failed / unexpected pos"), which is how
    ``torch.save`` reports a full disk."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
            return True
        text = str(exc)
        if isinstance(exc, RuntimeError) and "inline_container" in text and (
                "write failed" in text or "unexpected pos" in text):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def no_space_error(path: object) -> UserError:
    return UserError(f"No space left on the device while writing '{path}' (nothing half-written is kept); free "
                     "space, then continue with --resume RUN_DIR (for synth: the same command again).")
