"""``eval.baseline``: a committed result of the same recipe without privacy, shown beside a run's metrics.

The file (e.g. ``recipes/baselines/quickstart-nonprivate.json``) holds the metrics of a non-private run of public
benchmark data and the recipe sections it ran with, so a run's result may quote it. It is shown only when the
run's ``model``, ``data``, ``task`` and ``train`` sections equal the baseline's (privacy and evaluation settings
aside): with another model or learning rate it would not be the same recipe, and the summary says which key
differs instead. The path is relative to the working directory, or else to the dptext checkout (shipped files).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from dptext.errors import UserError

COMPARED = ("model", "data", "task", "train")
CHECKOUT = Path(__file__).resolve().parents[2]


def check_baseline(recipe: Any) -> None:
    """Refuse a missing or unreadable baseline before anything is written."""
    if recipe.eval.baseline:
        read_baseline(recipe.eval.baseline)


def _locate(path: str) -> Path:
    for candidate in (Path(path), CHECKOUT / path):
        if candidate.is_file():
            return candidate
    raise UserError(f"eval.baseline '{path}' is not a file (relative to the working directory or the dptext "
                    "checkout); fix the path or set eval.baseline=null.")


def read_baseline(path: str) -> dict[str, Any]:
    try:
        found = json.loads(_locate(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"eval.baseline '{path}' is not readable JSON; fix it or set eval.baseline=null.") from exc
    if not isinstance(found, dict) or not isinstance(found.get("metrics"), dict) \
            or not isinstance(found.get("recipe"), dict):
        raise UserError(f"eval.baseline '{path}' needs a \"metrics\" and a \"recipe\" object (the sections it ran "
                        "with); write it as recipes/baselines/quickstart-nonprivate.json is written.")
    return found


def differences(recipe: Any, ran: dict[str, Any]) -> list[str]:
    """The dotted keys of the compared sections where ``recipe`` and the baseline's recipe differ."""
    mine = {name: dataclasses.asdict(getattr(recipe, name)) for name in COMPARED}
    return [f"{name}.{key}" for name in COMPARED for key in sorted(set(mine[name]) | set(ran.get(name, {})))
            if mine[name].get(key) != ran.get(name, {}).get(key)]


def baseline_summary(recipe: Any) -> dict[str, Any]:
    if not recipe.eval.baseline:
        return {}
    found = read_baseline(recipe.eval.baseline)
    return {"baseline": {"file": recipe.eval.baseline, "metrics": found["metrics"],
                         "description": found.get("description", ""),
                         "differs": differences(recipe, found["recipe"])}}
