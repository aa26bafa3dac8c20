"""The ``dptext`` Typer application and the process entry point.

``main`` owns error handling for every command: a ``UserError`` becomes one sentence on
stderr and exit code 2; ``--debug`` (accepted anywhere on the command line) shows the
traceback instead. Genuine bugs are reported as such, with the same ``--debug`` hint.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import shlex
import sys
import traceback

import click
import typer

import dptext
from dptext.allocator import keep_freed_memory
from dptext.errors import RunInterrupted, UserError, is_no_space
from dptext.locking import release_all
from dptext.output import StdoutClosed

HELP = """Differentially private language models.

Fine-tune with DP-SGD/DP-Adam, account for privacy, decode privately, distil, and audit.
Run `dptext COMMAND --help` for the options of each command.
"""


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="dptext",
        help=HELP,
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode="rich",
        context_settings={"help_option_names": ["-h", "--help"]},
    )

    @app.callback(invoke_without_command=True)
    def _root(
        version: bool = typer.Option(False, "--version", help="Print the dptext version and exit."),
        debug: bool = typer.Option(
            False, "--debug", help="Show full tracebacks for errors (accepted anywhere on the command line)."
        ),
    ) -> None:
        if version:
            typer.echo(f"dptext {dptext.__version__}")
            raise typer.Exit(0)

    import dptext.cli as cli_package

    for info in sorted(pkgutil.iter_modules(cli_package.__path__), key=lambda m: m.name):
        if info.name in {"app", "common"}:
            continue
        module = importlib.import_module(f"dptext.cli.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(app)
    return app


def _say_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


def _usage_sentence(exc: click.exceptions.ClickException, args: list[str]) -> str:
    """Click's several-line usage error as one sentence naming the option and where help is."""
    message = " ".join(exc.format_message().split()).rstrip(".")
    command = getattr(getattr(exc, "ctx", None), "command_path", None) or "dptext"
    return f"{message}; see `{command} --help`."


class _PipeGuard:
    """stdout whose closed pipe raises ``StdoutClosed`` (click would turn the BrokenPipeError into a silent exit 1)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise StdoutClosed from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise StdoutClosed from None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> None:
    """Run one command; exit 2 with one sentence for a user error, 1 for a bug, 130 when interrupted."""
    if argv is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # one rank of a torchrun process group
        run_as_rank(lambda: _main(argv))
    _main(argv)


def run_as_rank(work) -> None:
    """Run ``work()``, then end the process at once with its exit code (a ``SystemExit``'s, 1 after a traceback),
    past the interpreter's teardown (everything it writes is closed by then; stdout and stderr are flushed).

    At teardown gloo's C++ threads can still release tensors tied to Python objects; a thread that asks for the
    GIL while the interpreter is finalising is ended with pthread_exit, which aborts the process ("terminate
    called without an active exception", SIGABRT): a finished run reported as a failed one, now and then
    (the mechanism of pytorch/pytorch pull request 179291)."""
    try:
        work()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # --debug's traceback
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, StdoutClosed):
            pass
    os._exit(code)


def _main(argv: list[str] | None) -> None:
    if argv is None:  # the process entry point (console script, `python -m dptext`, torchrun), not a test's call
        keep_freed_memory()
        sys.stdout = _PipeGuard(sys.stdout)
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("DPTEXT_DEBUG") == "1"
    args = [a for a in args if a != "--debug"]
    if args[:2] == ["mia", "canary"] and not os.path.isdir("canary"):  # a sub-command of its own, with its own help
        args = ["mia canary", *args[2:]]
    try:
        try:
            code = build_app()(args=args, prog_name="dptext", standalone_mode=False)
            sys.stdout.flush()  # here, not at exit, so a closed pipe is caught below
        finally:
            release_all()  # the command's run-folder locks (an in-process call, e.g. a test, may run another)
    except UserError as exc:
        if debug:
            raise
        _say_error(str(exc))
        sys.exit(2)
    except click.exceptions.ClickException as exc:
        if debug:
            raise
        _say_error(_usage_sentence(exc, args))
        sys.exit(2 if isinstance(exc, click.exceptions.UsageError) else exc.exit_code)
    except RunInterrupted as exc:  # Ctrl-C, acted on by a training run (dptext.finetune.interrupts)
        command = next((a for a in args if not a.startswith("-")), "finetune")
        hint = f"; continue with: dptext {command} --resume {shlex.quote(str(exc.run_dir))}" if exc.resumable else ""
        _say_error(f"{exc}{hint}")  # the hint only where a checkpoint exists to continue from
        sys.exit(130)
    except (click.exceptions.Abort, KeyboardInterrupt):
        code = 130
    except (BrokenPipeError, StdoutClosed):  # `dptext data ... | head`: the reader stopped reading, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's own flush cannot fail again
        sys.exit(0)
    except Exception as exc:  # a bug, not a user mistake
        if debug:
            raise
        if is_no_space(exc):  # a full disk outside the run's own writers (a cache, a plot, a library's files)
            _say_error(f"no space left on the device ({exc}); free space, then run the command again.")
            sys.exit(2)
        _say_error(
            f"dptext hit an unexpected {type(exc).__name__}: {exc}. "
            "Re-run with --debug for the traceback and please report it."
        )
        sys.exit(1)
    if code == 130:  # Typer turns Ctrl-C into a silent exit 130 (a training run says more: RunInterrupted)
        _say_error("interrupted.")
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
