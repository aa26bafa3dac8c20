"""Shadow / reference models: the target's recipe trained on random halves of its public pool.

Both the shadow-model attack (Shokri et al.) and offline LiRA (Carlini et al. 2022) need models trained
exactly like the target but on data that excludes the audited points. The target run set those points apart
(``audit.public_examples``: records of the same source that neither the target nor its non-members use, so
"public" by construction), and reference i trains on a seeded random half of them through the training entry
point the caller passes in (``dptext mia`` passes ``run_finetune``; attacks sit below the training runs and never
call them themselves) with ``audit.train_indices`` naming that half. Both attacks share the same references: shadow
model i's members are its half, its non-members the other half of the pool. They live in
``RUN_DIR/mia_not_private/references/ref-NN/`` (complete run directories) and are reused by later audits.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any, Callable

from dptext.attacks.audit_records import mia_folder, read_records
from dptext.config import Recipe, from_dict, to_dict
from dptext.errors import UserError
from dptext.runs import RunDir

REFERENCES = "references"


def reference_recipe(recipe: Any, indices: list[int], number: int, sample_rate: float, steps: int) -> Any:
    """The target's recipe on ``indices`` of its training split, with its own training seed and no evaluation.

    A reference has fewer records than the target, so it keeps the target's sampling rate q and step count
    (batch size q·n_ref; Li et al. App. L transfer q and steps, not batch size and epochs): the same
    optimisation, and for a private target the same noise multiplier up to δ = 1/(2n).
    """
    data = to_dict(recipe)
    data["name"] = f"{recipe.name}-ref{number:02d}"
    data["train"]["batch_size"] = max(1, round(sample_rate * len(indices)))
    data["train"]["max_steps"] = steps
    data["audit"] = {"train_indices": sorted(indices), "seed": recipe.audit.seed}
    data["train"]["seed"] = recipe.train.seed + 1 + number
    data["eval"]["before_training"] = False
    data["data"]["max_eval_examples"] = 0  # a reference model is only scored, never evaluated
    # trained on public records and never released: its δ = 1/(2n) of a small pool (n = 4: 0.125) imitates the
    # target's noise, it claims nothing, so the refusal of δ ≥ 0.1 (for runs whose ε someone reads) is waived
    data["privacy"]["allow_large_delta"] = True
    return from_dict(Recipe, data)


def reference_halves(public_indices: list[int], count: int, seed: int) -> list[list[int]]:
    """``count`` seeded random halves of the public pool (the members of each reference model)."""
    if len(public_indices) < 4:
        raise UserError("Shadow and reference models need a public pool; fine-tune the target with "
                        "audit.public_examples=N (N about twice the members, so references match its size).")
    halves = []
    for number in range(count):
        order = list(public_indices)
        random.Random(f"reference-{seed}-{number}").shuffle(order)
        halves.append(sorted(order[: len(order) // 2]))
    return halves


def train_references(target: Any, count: int, output: Any, train: Callable[..., Any]) -> list[dict[str, Any]]:
    """Train (or reuse) ``count`` reference models of the run ``target``; returns [{path, members}] per model.

    ``train`` is ``run_finetune`` (its ``recipe``/``out``/``resume``/``output`` keywords), passed in by the caller.
    """
    if count < 1:
        raise UserError("Shadow and LiRA attacks need at least one reference model; pass --references 1 or more.")
    public = [row["index"] for row in read_records(target.path, "public")]
    models = []
    for number, half in enumerate(reference_halves(public, count, target.recipe.audit.seed)):
        path = mia_folder(target.path) / REFERENCES / f"ref-{number:02d}"
        if not (path / "result.json").is_file():
            output.info(f"Training reference model {number + 1} of {count} on {len(half)} public records "
                        f"({path}).")
            if RunDir(path).latest_checkpoint() is not None:
                train(resume=path, output=output)
            else:  # nothing worth keeping from an attempt that stopped before its first checkpoint
                shutil.rmtree(path, ignore_errors=True)
                privacy = target.result["privacy"]
                recipe = reference_recipe(target.recipe, half, number, privacy["sample_rate"], privacy["steps"])
                train(recipe, out=path, output=output)
        recorded = RunDir.open(path).recipe().audit.train_indices
        if sorted(recorded) != half:
            raise UserError(f"{path} was trained on other records than this audit expects; delete it to retrain.")
        models.append({"path": path, "members": set(half)})
    return models
