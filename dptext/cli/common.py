"""Options and helpers shared by every command."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from typing_extensions import Annotated

from dptext.output import Output

JsonOption = Annotated[
    bool, typer.Option("--json", help="Print one JSON document on stdout instead of tables (for scripts).")
]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="Print only the final result.")]
OutOption = Annotated[
    Optional[Path],
    typer.Option("--out", help="Run directory to write (default: runs/<recipe>-<timestamp>/)."),
]
ResumeOption = Annotated[
    Optional[Path],
    typer.Option("--resume", help="Continue the run in this directory exactly where it stopped."),
]
OverridesArgument = Annotated[
    Optional[List[str]],
    typer.Argument(
        help="Dotted overrides of recipe fields, e.g. privacy.target_epsilon=3 train.epochs=1.",
        show_default=False,
    ),
]


def make_output(json_mode: bool = False, quiet: bool = False) -> Output:
    return Output(json_mode=json_mode, quiet=quiet)


def recipe_to_run(recipe: Path | None, overrides: list[str] | None, resume: Path | None):
    """The recipe a new run starts from (with overrides applied), or None when ``--resume`` continues a run."""
    from dptext.config import load_recipe
    from dptext.errors import UserError

    if resume is not None and (recipe is not None or overrides):
        raise UserError("--resume continues a run with its own resolved.yaml; drop the recipe and overrides.")
    return load_recipe(recipe, overrides or []) if recipe is not None else None


def render_not_covered(output, run_dir: Path) -> None:
    """Which of the run's files ε does not cover (from release.json), so nobody ships them by mistake."""
    manifest = run_dir / "release.json"
    if not manifest.is_file():
        return
    folders = sorted({f["path"].split("/")[0] + ("/" if "/" in f["path"] else "")
                      for f in json.loads(manifest.read_text())["files"] if f["status"] == "not_covered"})
    if folders:
        output.info(f"NOT covered by ε (keep with the private data, never publish): {', '.join(folders)}"
                    f"; `dptext account {run_dir}` says why and lists what ε covers.")
