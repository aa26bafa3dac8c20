"""``run_mia``: membership-inference audits of finished runs; what ``dptext mia`` calls and tests call.

For each run: reload the trained model, score its non-members and an equal-size seeded sample of its members
(SPEC §7: members vs held-out non-members, same size), run the requested attacks on the scores and summarise
each with AUC, TPR at FPR 1% and 0.1%, the ROC curve and an empirical ε lower bound at the run's δ, next to
the ε the accountant proved. The report is also written to ``RUN_DIR/mia_not_private/report.json`` (not covered by ε:
it scores individual records).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dptext.accounting.carried import carried_privacy
from dptext.accounting.events import resolve_delta
from dptext.attacks.attack_models import lira_offline, loss_attack, shadow_attack
from dptext.attacks.audit_records import mia_folder, read_records
from dptext.attacks.metrics import attack_summary
from dptext.attacks.references import train_references
from dptext.attacks.scoring import record_scores
from dptext.attacks.target import load_trained_run
from dptext.errors import UserError
from dptext.output import Output
from dptext.runs import RunDir, atomic_write_json, write_manifest

ATTACKS = ("loss", "shadow", "lira")
REPORT = "report.json"


def audited_points(run_path: Path, max_examples: int | None, seed: int) -> tuple[list, list]:
    """(members, non-members) rows: every non-member (or ``max_examples`` of them) and as many members."""

    members, nonmembers = read_records(run_path, "members"), read_records(run_path, "nonmembers")
    if not nonmembers:
        raise UserError(f"Run '{run_path}' held out no non-members; fine-tune it with audit.holdout_fraction "
                        "(or audit.holdout_examples) set to audit membership.")
    rng = random.Random(f"mia-points-{seed}")
    size = min(len(members), len(nonmembers), max_examples or len(nonmembers))
    return rng.sample(members, size), rng.sample(nonmembers, size)


def proven_privacy(target: Any) -> dict[str, Any]:
    privacy = target.result["privacy"]
    if not privacy["private"]:
        return {"private": False, "epsilon": None, "delta": resolve_delta(None, privacy["dataset_size"])[0]}
    carried = carried_privacy(target.result)  # the accountant's upper bound, a DPKD teacher's share included
    return {"private": True, "epsilon": carried["epsilon"], "accountant": carried["accountant"],
            "delta": carried["delta"]}


def _score(task: Any, model: Any, rows: list, batch_size: int, output: Any, what: str) -> dict[str, np.ndarray]:
    with output.progress(len(rows), what) as progress:
        return record_scores(task, model, [row["record"] for row in rows], batch_size, progress.advance)


def _reference_scores(target: Any, audited: list, count: int, batch_size: int, output: Any,
                      train: Callable[..., Any]) -> dict[str, Any]:
    """Each reference model's scores on the audited points (all OUT) and on the public pool (half IN)."""
    public = read_records(target.path, "public")
    lira, features, membership = [], [], []
    for number, reference in enumerate(train_references(target, count, output, train)):
        model = load_trained_run(reference["path"]).model
        scores = _score(target.task, model, audited + public, batch_size, output, f"scoring reference {number + 1}")
        lira.append(scores["confidence_logit"][: len(audited)])
        features.append(scores["features"][len(audited):])
        membership.append([row["index"] in reference["members"] for row in public])
        del model
    return {"lira": np.stack(lira), "features": np.concatenate(features),
            "membership": np.concatenate(membership).astype(float)}


def audit_run(run_dir: str | Path, attacks: tuple[str, ...], references: int = 2, max_examples: int | None = None,
              batch_size: int = 32, output: Any = None, seed: int = 0, confidence: float = 0.95,
              train: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Audit one run; ``train`` (``run_finetune``) trains the reference models the shadow and lira attacks need."""
    output = output or Output(quiet=True)
    unknown = [a for a in attacks if a not in ATTACKS]
    if unknown:
        raise UserError(f"Unknown attack {unknown[0]!r}; choose loss, shadow, lira or all.")
    if set(attacks) & {"shadow", "lira"} and train is None:
        raise ValueError("shadow and lira attacks train reference models: pass train=run_finetune")
    target = load_trained_run(run_dir)
    members, nonmembers = audited_points(target.path, max_examples, seed)
    audited = members + nonmembers
    scores = _score(target.task, target.model, audited, batch_size, output, "scoring target")
    is_member = np.r_[np.ones(len(members), bool), np.zeros(len(nonmembers), bool)]
    privacy = proven_privacy(target)
    member_scores: dict[str, np.ndarray] = {"loss": loss_attack(scores["loss"])}
    if "shadow" in attacks or "lira" in attacks:
        shadows = _reference_scores(target, audited, references, batch_size, output, train)
        member_scores["shadow"] = shadow_attack(shadows["features"], shadows["membership"], scores["features"])
        member_scores["lira"] = lira_offline(scores["confidence_logit"], shadows["lira"])
    report = {
        "run_dir": str(target.path), "recipe": target.recipe.name, "model": target.recipe.model.name,
        "task": target.recipe.task.type, "privacy": privacy, "members": len(members), "nonmembers": len(nonmembers),
        "references": references if set(attacks) & {"shadow", "lira"} else 0,
        "attacks": {name: attack_summary(member_scores[name][is_member], member_scores[name][~is_member],
                                         delta=privacy["delta"], confidence=confidence)
                    for name in ATTACKS if name in attacks},
    }
    atomic_write_json(mia_folder(target.path) / REPORT, report)
    write_manifest(target.path)
    return report


def run_mia(run_dirs: list[str | Path], attacks: tuple[str, ...], **options: Any) -> list[dict[str, Any]]:
    if not run_dirs:
        raise UserError("Give at least one run directory to audit.")
    if options.get("max_examples") is not None and options["max_examples"] < 1:  # 0 would mean "all" below
        raise UserError(f"--max-examples must be at least 1 (leave it out to audit every held-out example), got "
                        f"{options['max_examples']}.")
    for run_dir in run_dirs:  # every run is checked before the first one is attacked (which takes minutes)
        if RunDir.open(run_dir).load_result() is None:
            raise UserError(f"Run '{run_dir}' has not finished (no result.json); finish it with "
                            f"`dptext finetune --resume {run_dir}` before auditing it.")
    return [audit_run(run_dir, attacks, **options) for run_dir in run_dirs]
