"""``compare_canary_units``: one recipe trained at example level and at user level, with canaries that are each one
synthetic user repeating a secret, and the canaries' exposure side by side (issue 24).

With ``audit.canary_unit=user`` the r copies of a canary belong to one user. Example-level DP bounds what one copy
can reveal, so r copies are covered only by group privacy (about r·ε); user-level DP (``privacy.unit=user``) bounds
the whole user, whatever r (each step uses at most k of its copies, k = ``privacy.max_examples_per_user``). The two
runs differ in ``privacy.unit`` alone: same data, same canaries, same seeds, same target ε.

Training is the caller's (``dptext mia`` passes ``run_finetune``; attacks never call training themselves), and a
run that exists is reused, or resumed from its last checkpoint, so an interrupted comparison continues.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

from dptext.attacks.canary_audit import canary_exposure
from dptext.errors import UserError
from dptext.runs import RunDir

UNITS = ("example", "user")


def unit_overrides(unit: str) -> list[str]:
    """What the run of ``unit`` sets on top of the recipe: the privacy unit, and canaries as one user each (the
    example-level run drops k, which only means something per user)."""
    bound = [] if unit == "user" else ["privacy.max_examples_per_user="]
    return [f"privacy.unit={unit}", *bound, "audit.canary_unit=user"]


def check_comparable(recipes: dict[str, Any]) -> None:
    """Refuse, before anything trains, a comparison that could not show the difference between the two units."""
    user = recipes["user"]
    if not user.audit.canaries:
        raise UserError("--compare-units measures canaries; set audit.canaries=N (a language-model task).")
    if not user.data.user_column:
        raise UserError("User-level training needs each record's user; set data.user_column to the column that "
                        "names it.")
    if not user.privacy.enabled:
        raise UserError("--compare-units compares two private runs; set privacy.enabled=true and a target ε.")


def train_or_reuse(recipe: Any, path: Path, train: Callable[..., Any], output: Any) -> None:
    """A finished run is kept, a started one resumed, anything else trained from the start."""
    if (path / "result.json").is_file():
        output.info(f"Reusing the finished run {path}.")
    elif path.is_dir() and RunDir(path).latest_checkpoint() is not None:
        train(resume=path, output=output)
    else:  # nothing worth keeping from an attempt that stopped before its first checkpoint
        shutil.rmtree(path, ignore_errors=True)
        train(recipe, out=path, output=output)


def compare_canary_units(recipes: dict[str, Any], out: str | Path, train: Callable[..., Any], output: Any,
                         candidates: int = 2000, batch_size: int = 64) -> list[dict[str, Any]]:
    """``recipes``: unit → the recipe with ``unit_overrides(unit)`` applied; runs go to ``out/<unit>``. Returns
    the exposure report of each run, example level first."""
    check_comparable(recipes)
    reports = []
    for unit in UNITS:
        path = Path(out) / unit
        output.info(f"{unit}-level run with canaries as users: {path}")
        train_or_reuse(recipes[unit], path, train, output)
        reports.append(canary_exposure(path, candidates=candidates, batch_size=batch_size, output=output))
    return reports
