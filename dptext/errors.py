"""The one exception type for mistakes a user can fix.

A ``UserError`` is rendered by the CLI as a single sentence (what is wrong and what to
do) with exit code 2 and no traceback; ``--debug`` shows the traceback. Library code
raises it for bad input (missing files, bad recipe values, impossible privacy targets)
and lets genuine bugs propagate as ordinary exceptions.
"""


class UserError(Exception):
    """A problem with the user's input, explained in one sentence with the fix."""


class RunInterrupted(Exception):
    """Ctrl-C stopped a training run cleanly: the current step finished and was checkpointed.

    Not a ``KeyboardInterrupt``: Typer turns those into a silent exit 130, and this one must reach the CLI's
    error handler, which prints the ``--resume`` command."""

    def __init__(self, run_dir: object, step: int):
        super().__init__(f"interrupted after step {step} (checkpoint written)")
        self.run_dir, self.step = run_dir, step
