"""``canary_exposure``: how far a run's canaries stand out among all possible secrets (secret sharer).

Every canary and ``candidates`` secrets drawn uniformly from R (all of R when it is that small) are scored by
their log-perplexity under the trained model: the summed loss of the secret's tokens after the prefix (for
``language_modeling`` the prefix tokens are in the sum too, but they are the same for every secret, so the
ranking is that of the secret alone). Exposure per canary as ``dptext.attacks.exposure`` defines it, and its
mean, min and max per repetition count. The report names the run's privacy unit and the canaries' unit
(``audit.canary_unit``: a canary's copies as one synthetic user, or one user each). The fitted exposure is
capped at log₂|R| (rank 1); the uncapped tail estimate is kept as ``fitted_tail_bits``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dptext.attacks.audit import proven_privacy
from dptext.attacks.audit_records import mia_folder, read_canaries
from dptext.attacks.exposure import exposure_from_rank, fitted_exposure, sampled_exposure
from dptext.attacks.target import load_trained_run
from dptext.data.canaries import canary_record, sample_candidates
from dptext.output import Output
from dptext.runs import atomic_write_json, write_manifest
from dptext.tasks import build_task
from dptext.tasks.base import batches

CANARY_REPORT = "canaries.json"


def _log_perplexities(target: Any, secrets: list[str], prefix: str, batch_size: int, output: Any,
                      what: str) -> np.ndarray:
    recipe = target.recipe
    summed = dataclasses.replace(recipe, task=dataclasses.replace(recipe.task, loss_reduction="sum"))
    task = build_task(summed, target.tokenizer, [])
    records = [canary_record(recipe.task.type, prefix, s, recipe.task.control_codes) for s in secrets]
    values = []
    with torch.no_grad(), output.progress(len(records), what) as progress:
        for chunk in batches(task.encode(records), batch_size):
            batch = task.collate(chunk)
            values.append(task.per_example_loss(target.model, batch).float().cpu().numpy())
            progress.advance(len(chunk))
    return np.concatenate(values) / math.log(2)  # bits


def canary_exposure(run_dir: str | Path, candidates: int = 2000, batch_size: int = 64, output: Any = None,
                    seed: int = 0) -> dict[str, Any]:
    output = output or Output(quiet=True)
    target = load_trained_run(run_dir)
    canaries = read_canaries(target.path)
    space = canaries["space_size"]
    pool, exhaustive = sample_candidates(canaries, candidates, seed)
    prefix = canaries["prefix"]
    pool_scores = _log_perplexities(target, pool, prefix, batch_size, output, "scoring candidates")
    canary_scores = _log_perplexities(target, [c["secret"] for c in canaries["canaries"]], prefix, batch_size,
                                      output, "scoring canaries")
    rows = []
    for canary, score in zip(canaries["canaries"], canary_scores):
        if exhaustive:  # every other secret was scored: the rank is exact
            rank = 1 + float(np.sum(pool_scores < score)) + float(np.sum(pool_scores == score)) / 2
            exposure = exposure_from_rank(rank, space)
        else:
            exposure = sampled_exposure(score, pool_scores, space)
        fit = fitted_exposure(score, pool_scores)
        # exposure cannot exceed log2|R| (rank 1); a fitted tail beyond that only says "ranked first"
        rows.append({**canary, "log_perplexity_bits": float(score), "exposure_sampled": exposure,
                     "exposure_fitted": min(fit["exposure"], math.log2(space)), "fitted_tail_bits": fit["exposure"],
                     "fit": fit["family"]})
    groups = []
    for repetitions in sorted({c["repetitions"] for c in rows}):
        members = [r for r in rows if r["repetitions"] == repetitions]
        group = {"repetitions": repetitions, "canaries": len(members)}
        for key in ("exposure_sampled", "exposure_fitted"):
            values = [r[key] for r in members]
            group.update({f"{key}_mean": float(np.mean(values)), f"{key}_min": float(np.min(values)),
                          f"{key}_max": float(np.max(values))})
        groups.append(group)
    privacy = proven_privacy(target)
    # privacy.unit / max_examples_per_user come with issue 24's training loop; older recipes are example-level
    privacy["unit"] = target.recipe.privacy.unit
    privacy["max_examples_per_user"] = getattr(target.recipe.privacy, "max_examples_per_user", None)
    report = {"run_dir": str(target.path), "recipe": target.recipe.name, "privacy": privacy,
              "canary_unit": canaries.get("unit", "example"),
              "space_size": space, "log2_space_size": math.log2(space), "candidates": len(pool),
              "exhaustive": exhaustive, "resolution_bits": math.log2(len(pool)), "prefix": prefix,
              "by_repetitions": groups, "canaries": rows}
    atomic_write_json(mia_folder(target.path) / CANARY_REPORT, report)
    write_manifest(target.path)
    return report
