"""``synthesize``: DP synthetic text from a DP-fine-tuned teacher, conditioned on control codes.

DistilDP step 3 (SPEC §6). The teacher is a finished ``dptext finetune`` run directory (its
``model/``, ``resolved.yaml`` and ``result.json`` with ε). Codes are drawn from a DP histogram
of the teacher's training codes over the declared code domain (``task.code_domain`` or
``--code-domain``; the paper's exact distribution only with ``--codes exact``, which marks the
output not covered; see ``dptext.distill.codes``) and each one prompts the teacher, which samples
the text with top-k / top-p / temperature up to ``max_new_tokens``. Sampling from a DP model is
post-processing; the privacy of the output is the teacher's plus the histogram's (basic
composition), recorded in ``provenance.json`` so the claim travels with the data.

Output folder (every file registered in ``dptext.release``, listed with its status in ``release.json``)::

    plan.json          settings, the code histogram, codes of every record (drawn once), split: the resume contract
    chunks/            part-NNNNN.jsonl, one batch each, written atomically while generating
    train.jsonl        records {<code fields>, "code", "text", "tokens", "index"} (when complete)
    validation.jsonl
    summary.json       code coverage, lengths, duplicates, throughput (of the synthetic records only)
    provenance.json    teacher run, its ε/δ and accountant, code mechanism and its ε, total ε
    ledger.json        ε and δ spent: the teacher's DP-SGD run and the code histogram, composed
    training_copies_not_private.json   with --check-training-copies: copies of private texts (not covered)
    release.json       what ε covers

Resuming: a batch's sampling RNG is seeded from (seed, batch index) alone, and a batch is
either fully on disk or not at all, so an interrupted run continued later writes exactly
the records a straight-through run writes (same code, same device and library versions).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from dptext.accounting.carried import ONE_RUN, carried_privacy
from dptext.data import load_records
from dptext.distill.chunked_generation import CHUNKS, completed_chunks, generate_all, read_chunks
from dptext.distill.codes import (CodeDistribution, check_composed_delta, code_distribution, compose_basic,
                                  sample_codes, total_variation)
from dptext.errors import UserError
from dptext.finetune.setup import pick_device
from dptext.locking import check_unlocked, lock_folder
from dptext.models import load_model
from dptext.output import Output
from dptext.provenance import provenance
from dptext.release import inherited_flags
from dptext.runs import RunDir, atomic_write_json, atomic_write_text, write_manifest

PLAN, SUMMARY, PROVENANCE, LEDGER = "plan.json", "summary.json", "provenance.json", "ledger.json"
TRAINING_COPIES = "training_copies_not_private.json"
SPLIT_FILES = {"train": "train.jsonl", "validation": "validation.jsonl"}


def teacher_info(teacher: str | Path) -> dict[str, Any]:
    """What a finished teacher run says about itself: recipe, model folder, privacy."""
    run = RunDir.open(teacher)
    result = run.load_result()
    model_dir = run.path / "model"
    if result is None or not (model_dir / "config.json").is_file():
        raise UserError(f"Teacher run '{teacher}' has not finished (no result.json or model/); finish it with "
                        f"`dptext finetune --resume {teacher}` first.")
    recipe = run.recipe()
    if recipe.task.type != "language_modeling" or not recipe.task.control_codes:
        raise UserError(f"Teacher run '{teacher}' is not a control-coded language model (task.type="
                        f"{recipe.task.type}, control_codes={recipe.task.control_codes}); fine-tune the teacher with "
                        "task.type=language_modeling and task.control_codes set.")
    if recipe.privacy.enabled and recipe.privacy.unit == "user":  # its histogram of codes would count examples
        raise UserError(f"Teacher run '{teacher}' was trained with user-level DP (privacy.unit=user), which `dptext "
                        "synth` cannot compose with its per-example code histogram; use an example-level teacher.")
    return {"run": run, "recipe": recipe, "result": result, "model_dir": model_dir,
            "privacy": teacher_privacy(result, str(run.path.resolve()))}


def teacher_privacy(result: dict[str, Any], run_path: str) -> dict[str, Any]:
    """The (ε, δ) the teacher's model carries (``carried_privacy``: its accountant's upper bound, plus whatever a
    distilled teacher inherited), from its result.json."""
    carried = carried_privacy(result)
    if not carried["private"]:
        return {"teacher_run": run_path, "private": False, "epsilon": None, "delta": None, "accountant": None,
                "note": "the teacher was trained WITHOUT differential privacy: nothing derived from it is DP"}
    privacy = result["privacy"]
    # the own steps' ε by every accountant, where they are the whole story (not for a DPKD or inherited teacher)
    alone = carried["composition"] == ONE_RUN  # then privacy["epsilon"] is the own run's by-method dict
    by_method = {"epsilon_by_method": {m: e["epsilon"] for m, e in privacy["epsilon"].items()}} if alone else {}
    return {"teacher_run": run_path, "private": True, "epsilon": carried["epsilon"], "delta": carried["delta"],
            "accountant": carried["accountant"], "composition": carried["composition"],
            **by_method,
            "noise_multiplier": privacy.get("noise_multiplier"), "steps": privacy.get("steps"),
            "sample_rate": privacy.get("sample_rate")}


def combined_privacy(teacher: dict[str, Any], codes: CodeDistribution) -> dict[str, Any]:
    """The synthetic data's privacy: teacher ⊕ code histogram (basic composition), with what is not covered."""
    if not teacher["private"]:
        return {"epsilon": None, "delta": None, "composition": "none", "note": teacher["note"]}
    total = compose_basic(teacher["epsilon"], teacher["delta"], codes)
    if codes.mechanism == "exact":
        note = ("NOT COVERED: codes sampled from the EXACT private code distribution (--codes exact, as in the "
                "paper); the code frequencies are not protected and not counted in ε")
    else:
        note = "DP code histogram over the declared code domain: counts and support protected"
    return {**total, "composition": "basic: ε = ε_teacher + ε_codes, δ = δ_teacher + δ_codes", "note": note}


def synth_ledger(teacher: dict[str, Any], codes: CodeDistribution) -> dict[str, Any]:
    """What the synthetic data spent, mechanism by mechanism: the teacher's DP-SGD run and the code histogram,
    composed (``combined_privacy``). The teacher's own step-by-step ledger stays in its run directory."""
    spent = [{"mechanism": "DP-SGD (teacher)", "run": teacher["teacher_run"], "epsilon": teacher["epsilon"],
              "delta": teacher["delta"], "accountant": teacher["accountant"]}]
    if codes.mechanism != "exact":
        spent.append({"mechanism": f"{codes.mechanism} code histogram", "epsilon": codes.epsilon,
                      "delta": codes.delta})
    return {"kind": "dptext synthetic data: privacy ledger", "mechanisms": spent,
            "total": combined_privacy(teacher, codes)}


# --------------------------------------------------------------------------- the plan (resume contract)

def make_plan(info: dict[str, Any], n: int, settings: dict[str, Any], code_settings: dict[str, Any],
              validation_fraction: float, seed: int) -> dict[str, Any]:
    recipe = info["recipe"]
    records = load_records(recipe.data, "train")  # exactly the teacher's training set
    distribution = code_distribution(records, recipe.task.control_codes, code_settings["mechanism"],
                                     epsilon=code_settings["epsilon"], delta=code_settings["delta"],
                                     domain=code_settings["domain"] or recipe.task.code_domain or None)
    codes = sample_codes(distribution, n, seed)
    n_validation = int(round(validation_fraction * n))
    validation = sorted(np.random.default_rng(seed + 1).choice(n, size=n_validation, replace=False).tolist())
    return {**plan_identity(info, n, seed, settings, code_settings), "distribution": distribution.to_dict(),
            "codes": [list(c) for c in codes], "validation_indices": validation}


def plan_identity(info: dict[str, Any], n: int, seed: int, settings: dict[str, Any],
                  code_settings: dict[str, Any]) -> dict[str, Any]:
    """What a resumed synthesis must share with the one that started the folder: the records on disk and the code
    histogram came from that teacher (its run and the (ε, δ) it carried) under those code settings, and the
    provenance written at the end states them."""
    return {"n": n, "seed": seed, "settings": settings, "code_settings": code_settings,
            "teacher": info["privacy"]["teacher_run"],
            "teacher_privacy": {k: info["privacy"][k] for k in ("private", "epsilon", "delta")}}


IDENTITY = {"n": "--n", "seed": "--seed", "settings": "generation settings", "teacher": "teacher run",
            "code_settings": "code histogram (--codes, --code-epsilon, --code-delta, --code-domain)",
            "teacher_privacy": "teacher (ε, δ)"}


def stored_plan(out: Path, identity: dict[str, Any]) -> dict[str, Any] | None:
    """The plan of a synthesis this folder already holds (None for a new folder), refused before anything is
    written if it was started with another teacher or other settings."""
    path = out / PLAN
    if not path.exists():
        return None
    plan = json.loads(path.read_text())
    asked = json.loads(json.dumps(identity))
    compared = [k for k in asked if k in plan or k != "teacher_privacy"]  # older plans lack teacher_privacy
    differ = sorted(k for k in compared if plan.get(k) != asked[k])
    if differ:
        raise UserError(f"{out} holds a synthesis started with other values of {'; '.join(IDENTITY[k] for k in differ)}"
                        "; resume it with the same teacher run and settings, or choose another --out.")
    return plan


def check_out(out: Path, top_p: float) -> None:
    """Refused before the teacher loads: an --out that is a file, a top-p outside (0, 1], another writer."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out '{out}' is a file, not a folder; choose a folder path for the synthetic data.")
    if not (0 < top_p <= 1):
        raise UserError(f"--top-p must be in (0, 1] (the share of probability mass sampled from), got {top_p}.")
    check_unlocked(out, "synthetic-data folder")


# --------------------------------------------------------------------------- generation

# --------------------------------------------------------------------------- summary

def summarize(records: list[dict[str, Any]], plan: dict[str, Any]) -> dict[str, Any]:
    distribution = CodeDistribution.from_dict(plan["distribution"])
    sampled = [tuple(plan["codes"][r["index"]]) for r in records]
    support = [c for c, p in zip(distribution.codes, distribution.probabilities) if p > 0]
    lengths = sorted(r["tokens"] for r in records)
    texts = [r["text"] for r in records]
    counts = Counter(texts)
    summary = {
        "n": len(records),
        "splits": {s: sum(r["split"] == s for r in records) for s in SPLIT_FILES},
        "code_coverage": {"codes_in_distribution": len(support), "codes_generated": len(set(sampled)),
                          "total_variation_to_distribution": total_variation(sampled, distribution),
                          "per_code": {" || ".join(map(str, c)): n
                                       for c, n in sorted(Counter(sampled).items(), key=str)}},
        "length_tokens": {"mean": statistics.fmean(lengths), "median": statistics.median(lengths),
                          "p90": lengths[int(0.9 * (len(lengths) - 1))], "max": lengths[-1], "min": lengths[0],
                          "hit_max_new_tokens": (sum(n >= plan["settings"]["max_new_tokens"] for n in lengths)
                                                 / len(lengths))},
        "empty_texts": sum(not t for t in texts),
        "exact_duplicate_rate": 1 - len(counts) / len(texts),
    }
    return summary


def training_copies(records: list[dict[str, Any]], training_texts: list[str]) -> dict[str, Any]:
    """Synthetic texts equal to a private training text: an exact statistic of the private data (not covered)."""
    private = {t.strip() for t in training_texts}
    copies = sum(r["text"] in private for r in records)
    return {"count": copies, "rate": copies / len(records),
            "note": "computed against the PRIVATE training texts: NOT covered by ε, for the data owner only"}


# --------------------------------------------------------------------------- entry point

def synthesize(teacher: str | Path, out: str | Path, n: int, *, code_mechanism: str = "laplace",
               code_epsilon: float | None = None, code_delta: float | None = None,
               code_domain: dict[str, list] | None = None, top_k: int = 50, top_p: float = 0.9,
               temperature: float = 1.0, max_new_tokens: int = 128, batch_size: int = 32,
               validation_fraction: float = 0.01, seed: int = 0, check_training_copies: bool = False,
               device: str = "auto", max_chunks: int | None = None, output: Any = None) -> dict[str, Any]:
    """Generate (or continue generating) ``n`` synthetic records into ``out``; returns the summary.

    ``max_chunks`` stops after that many batches (time-boxed runs; call again to continue).
    """
    output = output or Output(quiet=True)
    if n < 1 or batch_size < 1 or max_new_tokens < 1:
        raise UserError("n, batch size and max new tokens must all be at least 1.")
    if not 0 <= validation_fraction < 1:
        raise UserError(f"--validation-fraction must be in [0, 1), got {validation_fraction}.")
    out = Path(out)
    check_out(out, top_p)
    info = teacher_info(teacher)
    settings = {"top_k": top_k, "top_p": top_p, "temperature": temperature, "max_new_tokens": max_new_tokens,
                "batch_size": batch_size, "validation_fraction": validation_fraction}
    code_settings = {"mechanism": code_mechanism, "epsilon": code_epsilon, "delta": code_delta, "domain": code_domain}
    check_composed_delta(info, code_settings)
    # a finished folder too is compared first: another --n or teacher is refused, never answered "complete"
    plan = stored_plan(out, plan_identity(info, n, seed, settings, code_settings))
    if (out / PROVENANCE).exists():
        output.info(f"{out} is complete; its summary is below.")
        return json.loads((out / SUMMARY).read_text())
    lock_folder(out, "synthetic-data folder")
    new = plan is None
    if new:  # in memory first: a refused code domain leaves nothing on disk
        plan = make_plan(info, n, settings, code_settings, validation_fraction, seed)
    out.mkdir(parents=True, exist_ok=True)
    flags = (["exact_codes"] if code_mechanism == "exact" else []) + inherited_flags(info["privacy"]["teacher_run"])
    write_manifest(out, "synth", flags)  # before any other file
    if new:
        atomic_write_json(out / PLAN, plan)
    model, tokenizer = load_model(str(info["model_dir"]), head="causal_lm")
    model.to(pick_device(device)).eval()
    output.info(f"Teacher {info['privacy']['teacher_run']} (ε={info['privacy']['epsilon']}); {n} records, "
                f"{completed_chunks(out) * batch_size} already on disk.")
    speed = generate_all(model, tokenizer, plan, out, batch_size, output, max_chunks)
    if not speed["complete"]:
        return {"complete": False, "records_on_disk": min(completed_chunks(out) * batch_size, n), **speed}
    return finish(out, plan, info, speed, check_training_copies)


def finish(out: Path, plan: dict[str, Any], info: dict[str, Any], speed: dict[str, Any],
           check_training_copies: bool) -> dict[str, Any]:
    records = read_chunks(out)
    if [r["index"] for r in records] != list(range(plan["n"])):
        raise UserError(f"{out}/{CHUNKS} does not hold records 0..{plan['n'] - 1} exactly once; delete the folder "
                        "and generate again.")
    for split, name in SPLIT_FILES.items():
        atomic_write_text(out / name, "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                              for r in records if r["split"] == split))
    summary = {**summarize(records, plan), "throughput_this_session": speed}
    if check_training_copies:
        training = [r["text"] for r in load_records(info["recipe"].data, "train")]
        atomic_write_json(out / TRAINING_COPIES, training_copies(records, training))
    atomic_write_json(out / SUMMARY, summary)
    distribution = CodeDistribution.from_dict(plan["distribution"])
    codes = {k: v for k, v in distribution.to_dict().items()
             if k not in ("codes", "noisy_counts", distribution.probability_key)}
    atomic_write_json(out / PROVENANCE, {
        "kind": "dptext synthetic data (DistilDP)", "teacher": info["privacy"],
        "teacher_model": str(info["model_dir"].resolve()), "teacher_recipe": info["recipe"].name,
        "teacher_data": {"dataset": info["recipe"].data.dataset, "path": info["recipe"].data.path,
                         "max_train_examples": info["recipe"].data.max_train_examples},
        "control_codes": info["recipe"].task.control_codes, "code_distribution": codes,
        "privacy": combined_privacy(info["privacy"], distribution),
        "generation": plan["settings"], "n": plan["n"], "seed": plan["seed"], "software": provenance()})
    atomic_write_json(out / LEDGER, synth_ledger(info["privacy"], distribution))
    write_manifest(out, "synth")
    return summary
