"""The one exception type for mistakes a user can fix.

A ``UserError`` is rendered by the CLI as a single sentence (what is wrong and what to
do) with exit code 2 and no traceback; ``--debug`` shows the traceback. Library code
raises it for bad input (missing files, bad recipe values, impossible privacy targets)
and lets genuine bugs propagate as ordinary exceptions.
"""


class UserError(Exception):
    """A problem with the user's input, explained in one sentence with the fix."""
