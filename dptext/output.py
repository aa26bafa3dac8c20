"""The one output layer every command renders through.

Three audiences, one API:
* a person at a terminal gets rich tables and live progress bars;
* a log file or pipe (not a TTY) gets plain, greppable lines;
* a script passing ``--json`` gets exactly one JSON document on stdout, while
  progress and notes go to stderr so they never corrupt it.
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence
from dataclasses import asdict


def _jsonable(value: Any) -> Any:
    """Turn numpy/torch scalars, paths and dataclasses into plain JSON values."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _jsonable(value.item())
    if hasattr(value, "__dataclass_fields__"):
        return _jsonable(asdict(value))
    return str(value)


def format_value(value: Any) -> str:
    """Human formatting for table cells: 4 significant digits for floats."""
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3e}"
        return f"{value:.4g}"
    if value is None:
        return "-"
    return str(value)


class Progress:
    """Handle returned by ``Output.progress``: call ``advance`` once per unit of work."""

    def __init__(self, output: "Output", total: int | None, description: str, start: int = 0):
        self._out = output
        self.total = total
        self.description = description
        self.done = self._start_done = start  # work done before (a resumed run): not part of the current rate
        self.fields: dict[str, Any] = {}
        self._start = time.monotonic()
        self._last_plain = 0.0
        self._last_plain_done = -1
        self._rich = None
        self._task = None

    def advance(self, n: int = 1, **fields: Any) -> None:
        self.done += n
        self.fields.update(fields)
        if self._rich is not None:
            self._rich.update(self._task, advance=n, fields=self._fields_text())
        else:
            self._maybe_print_plain()

    def _fields_text(self) -> str:
        return "  ".join(f"{k}={format_value(v)}" for k, v in self.fields.items() if v is not None)

    def _maybe_print_plain(self, force: bool = False) -> None:
        now = time.monotonic()
        step = max(1, (self.total or 0) // 20)
        if self.done == self._last_plain_done:
            return
        if not force and now - self._last_plain < 10 and self.done % step and self.done != self.total:
            return
        self._last_plain, self._last_plain_done = now, self.done
        elapsed = now - self._start
        total = f"/{self.total}" if self.total else ""
        eta = ""
        if self.total and self.done > self._start_done:
            eta = f" eta {elapsed / (self.done - self._start_done) * (self.total - self.done):.0f}s"
        line = f"{self.description}: {self.done}{total} ({elapsed:.0f}s{eta}) {self._fields_text()}"
        print(line.rstrip(), file=sys.stderr, flush=True)


class Output:
    """Renders messages, tables, progress and results for one command invocation."""

    def __init__(self, json_mode: bool = False, quiet: bool = False):
        self.json_mode = json_mode
        self.quiet = quiet
        self.interactive = sys.stdout.isatty() and not json_mode
        self._console = None
        self._err_console = None

    # rich is imported on first use only; plain and JSON output never need it.
    @property
    def console(self):
        if self._console is None:
            # rich loads in ~0.1 s; `--json` and plain output, and `dptext --help`, never need it
            from rich.console import Console

            self._console = Console(highlight=False)
            self._console.on_broken_pipe = _closed_pipe  # rich would exit 1 silently; the CLI exits 0 instead
        return self._console

    @property
    def err_console(self):
        if self._err_console is None:
            # rich loads in ~0.1 s; `--json` and plain output, and `dptext --help`, never need it
            from rich.console import Console

            self._err_console = Console(stderr=True, highlight=False)
        return self._err_console

    def info(self, text: str) -> None:
        """A note for people; goes to stderr in JSON mode so stdout stays parseable."""
        if self.quiet:
            return
        if self.json_mode:
            print(text, file=sys.stderr)
        elif self.interactive:
            self.console.print(text)
        else:
            print(_strip_markup(text))

    def warn(self, text: str) -> None:
        """A warning always reaches stderr, in every mode."""
        if sys.stderr.isatty():
            self.err_console.print(f"[yellow]warning:[/yellow] {text}")
        else:
            print(f"warning: {_strip_markup(text)}", file=sys.stderr)

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """A table for people. In JSON mode tables are skipped: use ``result``."""
        if self.json_mode or self.quiet:
            return
        cells = [[format_value(v) for v in row] for row in rows]
        if self.interactive:
            # rich loads in ~0.1 s; `--json` and plain output, and `dptext --help`, never need it
            from rich.table import Table
            from rich.text import Text

            table = Table(title=title)
            for col in columns:
                table.add_column(col)
            for row in cells:  # Text, not markup: data such as E2E's "eatType[pub]" must print as is
                table.add_row(*(Text(cell) for cell in row))
            self.console.print(table)
            return
        widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
        print(title)
        print("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
        for row in cells:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())

    def result(self, data: Any) -> None:
        """The machine-readable result: printed as JSON in JSON mode, ignored otherwise."""
        if self.json_mode:
            print(json.dumps(_jsonable(data), indent=2, sort_keys=False))

    @contextmanager
    def progress(self, total: int | None, description: str, start: int = 0) -> Iterator[Progress]:
        """A live bar on a terminal, periodic plain lines on stderr otherwise; ``start`` units are already done
        (a resumed run), so the time left counts only the remaining ones at the current rate."""
        handle = Progress(self, total, description, start)
        if self.interactive and not self.quiet:
            # rich loads in ~0.1 s; `--json` and plain output, and `dptext --help`, never need it
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress as RichProgress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[fields]}"),
                console=self.console,
            )
            with bar:
                handle._rich = bar
                handle._task = bar.add_task(description, total=total, completed=start, fields="")
                yield handle
        else:
            yield handle
            if not self.quiet:
                handle._maybe_print_plain(force=True)


def _strip_markup(text: str) -> str:
    """Remove rich markup like ``[bold]`` for plain output."""
    if "[" not in text:
        return text
    from rich.text import Text  # rich loads in ~0.1 s; `--json` and plain output, and `dptext --help`, never need it

    return Text.from_markup(text).plain


class StdoutClosed(Exception):
    """The reader of stdout went away (`dptext data ... | head`); `dptext.cli.app.main` ends quietly with 0.

    Not an OSError: click turns an EPIPE OSError into a silent exit 1 before the CLI could see it."""


def _closed_pipe() -> None:
    raise StdoutClosed
