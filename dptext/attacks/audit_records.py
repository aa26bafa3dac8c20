"""What attacks read from a run's audit split, and the folder they write their own results to.

The split itself is chosen and written before training by ``dptext.data.audit_split``; attacks only read it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dptext.data.audit_split import AUDIT_DIR, CANARIES, FILES, NOT_PRIVATE_README, ONE_RUN, README
from dptext.errors import UserError
from dptext.runs import atomic_write_text, read_lines

MIA_DIR = "mia_not_private"
MIA_README = NOT_PRIVATE_README.format(title="Membership-inference results", body=(
    "Attack reports score individual training records; `references/` holds runs trained on subsets of the audit "
    "pool; canary reports contain the planted secrets."))


def mia_folder(run_path: str | Path) -> Path:
    """``RUN_DIR/mia_not_private/`` with its README: where attack reports and reference runs go."""
    folder = Path(run_path) / MIA_DIR
    if not (folder / README).is_file():
        atomic_write_text(folder / README, MIA_README)
    return folder


def read_records(run_path: str | Path, name: str) -> list[dict[str, Any]]:
    """``members``, ``nonmembers`` or ``public`` rows ({"index", "record"}) of a run's audit folder."""
    path = Path(run_path) / AUDIT_DIR / FILES[name]
    if not path.is_file():
        raise UserError(f"'{run_path}' has no {AUDIT_DIR}/{FILES[name]}; fine-tune with an audit section "
                        "(e.g. audit.holdout_fraction=0.2) to audit a run.")
    rows = []
    for number, line in enumerate(read_lines(path), start=1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # cut mid-line (a full disk, a copy interrupted): the audit would be skewed
            raise UserError(f"{path} is damaged at record {number} (cut short or edited); restore the run's "
                            f"{AUDIT_DIR} folder from a copy, or fine-tune the run again.") from None
    return rows


def _audit_json(run_path: str | Path, filename: str, missing: str) -> dict[str, Any]:
    path = Path(run_path) / AUDIT_DIR / filename
    if not path.is_file():
        raise UserError(f"'{run_path}' has no {missing}.")
    return json.loads(path.read_text(encoding="utf-8"))


def read_canaries(run_path: str | Path) -> dict[str, Any]:
    return _audit_json(run_path, CANARIES, "canaries; fine-tune with audit.canaries=K (a language-model task) to "
                       "measure exposure")


def read_one_run(run_path: str | Path) -> dict[str, Any]:
    """The one-run audit's canaries and their inclusion bits (``dptext.data.canaries.make_one_run_canaries``)."""
    return _audit_json(run_path, ONE_RUN, "one-run canaries; fine-tune it with audit.one_run_canaries=M (a "
                       "language-model task) to audit it in one run")
