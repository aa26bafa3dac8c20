"""``run_distill``: train (or just score) a student as the recipe's ``distill`` section says.

The student's run goes through ``run_finetune`` with a builder that swaps in the student, the
data and the objective, so the loop, checkpoints, resume and evaluation are fine-tuning's own:

============== ==================== ====================== ==============================================
method         trains on            objective              privacy of the student
============== ==================== ====================== ==============================================
distildp       synthetic data       (1−λ)CE + λt²KL [+αMSE] teacher's (ε, δ) + code histogram's: post-processing
synthetic_only synthetic data       CE (λ = 0)             the same
dp_sgd         private data, DP-SGD CE                     its own run at privacy.target_epsilon
dpkd           private data, DP-SGD (1−λ)CE + λt²KL        teacher (ε_T, δ_T) + student
                                                           (ε − ε_T, δ − δ_T)
zero_shot      nothing              —                      ε = 0 (the data is only used for the test score)
============== ==================== ====================== ==============================================

Budgets compose by basic composition (ε and δ add). Every method reports the student's
perplexity on the private data's ``eval.split`` (text only, the control code as the prompt,
as the teacher was trained). The student's run directory keeps ``student_init/`` (the model
it started from), ``student.json`` (which layers of which model) and, in ``result.json``,
``privacy`` with the ε the student carries and where it comes from.
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any

from dptext.accounting.events import check_large_delta
from dptext.data import load_records
from dptext.distill.student import build_student
from dptext.distill.synth import PROVENANCE, teacher_info
from dptext.distill.task import DistillationTask
from dptext.errors import UserError
from dptext.finetune.run import run_finetune
from dptext.finetune.setup import build_training, pick_device
from dptext.finetune.start_model import origin_marker
from dptext.finetune.task_probe import verify_with_task
from dptext.model_check import check_model_name
from dptext.models import load_model
from dptext.output import Output
from dptext.release import MANIFEST, ORIGIN
from dptext.runs import RunDir, atomic_write_json
from dptext.tasks.language_modeling import LanguageModelingTask

STUDENT_DIR = "student_init"
STUDENT_INFO = "student.json"
SYNTHETIC_METHODS = ("distildp", "synthetic_only")
KD_METHODS = ("distildp", "dpkd")


def check_recipe(recipe: Any) -> None:
    d = recipe.distill
    if d.method in SYNTHETIC_METHODS and not d.synthetic:
        raise UserError(f"distill.method={d.method} trains on synthetic data; set distill.synthetic to a folder "
                        "written by `dptext synth`.")
    if d.method in KD_METHODS and not d.teacher:
        raise UserError(f"distill.method={d.method} distils a teacher; set distill.teacher to its finetune run.")
    if d.method in ("dp_sgd", "dpkd") and (not recipe.privacy.enabled or recipe.privacy.target_epsilon is None):
        raise UserError(f"distill.method={d.method} is a DP baseline; set privacy.enabled=true and "
                        "privacy.target_epsilon to the total budget.")
    if recipe.privacy.unit == "user":  # the teacher budget split and the code histogram count examples
        raise UserError("dptext distill supports example-level DP only; set privacy.unit=example (user-level DP "
                        "is trained with `dptext finetune`).")
    if not d.student and not d.teacher:
        raise UserError("Name the student (distill.student) or a teacher run whose base model it starts from.")
    # the ranges of kd_lambda, temperature and hidden_alpha are declared in the schema; here, what is on disk
    if d.teacher and (RunDir.open(d.teacher).load_result() is None):
        raise UserError(f"distill.teacher '{d.teacher}' has not finished (no result.json); finish it with "
                        f"`dptext finetune --resume {d.teacher}` first.")
    teacher_run = d.teacher
    if d.method in SYNTHETIC_METHODS:
        teacher_run = teacher_run or synthetic_provenance(d.synthetic, None)["teacher"]["teacher_run"]
    teacher_recipe = RunDir.open(teacher_run).recipe() if teacher_run else None
    if d.student:
        check_model_name(d.student, key="distill.student")
    source = d.student or (teacher_recipe.model.name if teacher_recipe else None)
    if source:  # the student starts from d.student, else from the teacher's base model
        check_public_student(source, "distill.student" if d.student else f"the teacher's model.name ({teacher_run})")
    if teacher_recipe is not None:
        check_same_partition(recipe, teacher_recipe, teacher_run)


# what decides which records land in which split: equal in the teacher's recipe and the student's
PARTITION = ("dataset", "path", "text_column", "label_column", "validation_fraction", "split_seed", "user_column")


def _same_path(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a == b
    return a == b or Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def check_same_partition(recipe: Any, teacher_recipe: Any, teacher_run: str) -> None:
    """Every method scores the student on ``recipe``'s eval split and writes the score into the covered
    result.json; partitioned differently from the teacher's data (another path, split_seed, validation_fraction),
    that split can hold the teacher's training records, whose un-noised statistic ε would then not cover."""
    ours, theirs = recipe.data, teacher_recipe.data
    differ = [k for k in PARTITION if not (_same_path(ours.path, theirs.path) if k == "path"
                                           else getattr(ours, k) == getattr(theirs, k))]
    if differ:
        raise UserError(f"The distill recipe's data differs from the teacher run's ({teacher_run}) in "
                        f"{', '.join('data.' + k for k in differ)}, so its {recipe.eval.split} split may hold the "
                        "teacher's training records and the student's score on it would not be covered by ε; use "
                        "the teacher's data section (same source, split_seed and validation_fraction).")


def check_public_student(name: str, key: str = "distill.student") -> None:
    """The student's start (student_init/, registered public) must be a public model: a model folder in a dptext run
    directory or synth folder, or copied from a run's model/ (its dptext_origin.json), holds weights learnt from
    private data (without DP, or with an ε the student's claim does not count), so it is refused."""
    folder = Path(os.path.expanduser(name))
    if not folder.is_dir():
        return
    parents = [folder.resolve(), *folder.resolve().parents][:4]
    inside = [p for p in parents if any((p / m).is_file() for m in (MANIFEST, "resolved.yaml", "result.json"))]
    where = (f"lies in the dptext run directory '{inside[0]}'" if inside else  # or a copy of a run's model/:
             f"is a copy of a dptext run's model ({Path(ORIGIN).name} in it)" if origin_marker(name) else None)
    if where is not None:
        raise UserError(f"{key} '{name}' {where}: its weights were trained on private data, which the student's "
                        "privacy claim does not count and its student_init/ (public) would republish; start from a "
                        "public pretrained model (a hub name, an offline alias, or a layer subset of the teacher's "
                        "base model).")


def synthetic_provenance(folder: str, teacher_run: str | None) -> dict[str, Any]:
    path = Path(folder) / PROVENANCE
    if not path.is_file():
        raise UserError(f"'{folder}' holds no finished synthetic data ({PROVENANCE} missing); run or resume "
                        f"`dptext synth` into it first.")
    data = json.loads(path.read_text())
    if not isinstance(data.get("teacher"), dict) or (Path(folder) / "resolved.yaml").is_file():
        raise UserError(f"'{folder}' is a run directory, not a `dptext synth` folder; set distill.synthetic to the "
                        "--out folder of `dptext synth` (distill.teacher names the run).")
    if teacher_run is not None and data["teacher"]["teacher_run"] != teacher_run:
        raise UserError(f"The synthetic data in '{folder}' was generated by {data['teacher']['teacher_run']}, not "
                        f"by distill.teacher ({teacher_run}); use the matching teacher.")
    return data


def student_recipe(recipe: Any, student_dir: Path, teacher: dict | None, budget: dict | None) -> Any:
    """The fine-tuning recipe the student is trained with (not written anywhere: derived from the recipe)."""
    derived = copy.deepcopy(recipe)
    d = recipe.distill
    derived.model.name = str(student_dir)
    derived.task.type = "language_modeling"
    if not derived.task.control_codes and teacher is not None:
        derived.task.control_codes = list(teacher["recipe"].task.control_codes)
    if d.method in SYNTHETIC_METHODS:
        data = derived.data
        data.dataset, data.path, data.text_column, data.label_column = "jsonl", d.synthetic, "text", None
        data.max_train_examples = d.max_synthetic_examples
        derived.eval.split = "validation"  # the synthetic validation split; the real test split is set afterwards
        derived.privacy.enabled = False
    elif d.method == "dpkd":
        derived.privacy.target_epsilon = budget["student_epsilon"]
        derived.privacy.delta = budget["student_delta"]
        derived.privacy.noise_multiplier = None
    return derived


def dpkd_budget(recipe: Any, teacher: dict, n: int) -> dict[str, Any]:
    """The student's share of the budget: total minus the teacher's (basic composition)."""
    total_eps = recipe.privacy.target_epsilon
    total_delta = recipe.privacy.delta or 1.0 / (2 * n)
    # the composed claim's δ is refused as finetune refuses privacy.delta, not just the student's share of it
    check_large_delta(total_delta, "given" if recipe.privacy.delta else f"1/(2n) with n={n}",
                      recipe.privacy.allow_large_delta, "set privacy.allow_large_delta=true")
    t = teacher["privacy"]
    if not t["private"]:
        raise UserError("The DPKD teacher was trained without DP; train it with its share of the budget.")
    eps, delta = total_eps - t["epsilon"], total_delta - t["delta"]
    if eps <= 0 or delta <= 0:
        share = ("ε/2 and δ/2" if eps <= 0 and delta <= 0 else "ε/2" if eps <= 0
                 else "privacy.delta at δ/2, or a larger total privacy.delta here")
        raise UserError(f"The DPKD teacher already spent ε={t['epsilon']:.4g}, δ={t['delta']:.3g} of the total "
                        f"ε={total_eps:g}, δ={total_delta:.3g}; train the teacher with a smaller share ({share}).")
    return {"student_epsilon": eps, "student_delta": delta, "total_epsilon": total_eps, "total_delta": total_delta}


def ensure_student(recipe: Any, run: RunDir, teacher: dict | None) -> dict[str, Any]:
    """Build the initial student once per run directory (a resumed run reuses it)."""
    info_path = run.path / STUDENT_INFO
    if info_path.exists() and (run.path / STUDENT_DIR / "config.json").exists():
        return json.loads(info_path.read_text())
    d = recipe.distill
    source = d.student or teacher["recipe"].model.name
    _, _, description = build_student(source, d.student_layers, d.student_layer_stride, run.path / STUDENT_DIR)
    atomic_write_json(info_path, description)
    return description


def privacy_claim(recipe: Any, teacher: dict | None, synthetic: dict | None, budget: dict | None,
                  plan: Any) -> dict[str, Any]:
    """The (ε, δ) the student carries and how it was obtained."""
    method = recipe.distill.method
    if method in SYNTHETIC_METHODS:
        claim = synthetic["privacy"]
        return {"private": claim["epsilon"] is not None, "inherited": True, "epsilon": claim["epsilon"],
                "delta": claim["delta"], "composition": claim["composition"], "note": claim["note"],
                "teacher": synthetic["teacher"], "code_distribution": synthetic["code_distribution"],
                "student_training": "non-private optimizer on DP synthetic data and DP teacher outputs: "
                                    "post-processing, no further privacy cost (SPEC §6)"}
    if method == "dpkd":
        return {"private": True, "epsilon": budget["total_epsilon"], "delta": budget["total_delta"],
                "composition": "basic: teacher (ε_T, δ_T) + student DP-SGD (ε − ε_T, δ − δ_T)",
                "teacher": teacher["privacy"], "student_epsilon": budget["student_epsilon"],
                "student_delta": budget["student_delta"]}
    if method == "dp_sgd":
        return {"private": True, "epsilon": recipe.privacy.target_epsilon, "delta": plan.delta,
                "composition": "one DP-SGD run (the student's own ledger)"}
    return {"private": True, "epsilon": 0.0, "delta": 0.0, "note": "zero-shot student: no private data used"}


def build_student_training(recipe: Any, run: RunDir) -> Any:
    """``run_finetune``'s builder for a distillation run."""
    check_recipe(recipe)
    d = recipe.distill
    teacher = teacher_info(d.teacher) if d.teacher else None
    synthetic = None
    if d.method in SYNTHETIC_METHODS:
        synthetic = synthetic_provenance(d.synthetic, teacher["privacy"]["teacher_run"] if teacher else None)
        teacher = teacher or teacher_info(synthetic["teacher"]["teacher_run"])
    description = ensure_student(recipe, run, teacher)
    budget = dpkd_budget(recipe, teacher, len(load_records(recipe.data, "train"))) if d.method == "dpkd" else None
    derived = student_recipe(recipe, run.path / STUDENT_DIR, teacher, budget)
    teacher_in_loss = d.method in KD_METHODS and (d.kd_lambda > 0 or d.hidden_alpha > 0)
    training = build_training(derived, probe_now=not teacher_in_loss)  # probed below, with the teacher's loss
    if teacher_in_loss:
        teacher_model, teacher_tokenizer = load_model(str(teacher["model_dir"]), head="causal_lm")
        if teacher_tokenizer.get_vocab() != training.tokenizer.get_vocab():
            raise UserError("Teacher and student tokenizers differ; distil into a student with the teacher's "
                            "tokenizer (e.g. DistilGPT2 for GPT-2, a layer subset for SmolLM2).")
        teacher_model.to(training.device).eval().requires_grad_(False)
        training.task = DistillationTask(derived, training.tokenizer, teacher_model)
        training.task.check_hidden_sizes(training.model)
        if training.engine is not None and derived.privacy.verify:
            verify_with_task(training.engine, training.task, training.model, training.autocast_dtype)
            training.ledger.mechanism = training.engine.mechanism()  # now it says the clipping was verified
    training.final_records = load_records(recipe.data, recipe.eval.split)  # the real (private-distribution) split
    claim = privacy_claim(recipe, teacher, synthetic, budget, training.plan)
    training.info.update({"method": d.method, "student": description, "privacy_claim": claim,
                          "kd_lambda": d.kd_lambda if d.method in KD_METHODS else 0.0,
                          "temperature": d.temperature, "hidden_alpha": d.hidden_alpha,
                          "teacher_run": teacher["privacy"]["teacher_run"] if teacher else None,
                          "synthetic": str(Path(d.synthetic).resolve()) if synthetic else None,
                          "eval_split": recipe.eval.split})
    if d.method in SYNTHETIC_METHODS:  # the student's training itself is non-private; its guarantee is inherited
        training.info["privacy"] = {**claim, "steps": training.plan.steps,
                                    "expected_batch_size": training.plan.sample_rate * training.plan.dataset_size,
                                    "dataset_size": training.plan.dataset_size,
                                    "sample_rate": training.plan.sample_rate}
    return training


def run_zero_shot(recipe: Any, out: str | Path | None, output: Any) -> dict[str, Any]:
    """Score the untrained student on the private test split (the table's ε = 0 row)."""
    started = time.monotonic()
    run = RunDir.create(recipe, out)
    d = recipe.distill
    teacher = teacher_info(d.teacher) if d.teacher else None
    description = ensure_student(recipe, run, teacher)
    derived = student_recipe(recipe, run.path / STUDENT_DIR, teacher, None)
    model, tokenizer = load_model(str(run.path / STUDENT_DIR), head="causal_lm")
    model.to(pick_device(recipe.train.device))
    task = LanguageModelingTask(derived, tokenizer)
    records = load_records(recipe.data, recipe.eval.split)
    with output.progress(len(records), "evaluating") as progress:
        metrics = task.evaluate(model, records, batch_size=recipe.eval.batch_size, on_progress=progress.advance)
    run.log_metrics({"step": 0, "split": recipe.eval.split, **metrics})
    claim = privacy_claim(recipe, teacher, None, None, None)
    result = {"run_dir": str(run.path), "recipe": recipe.name, "model": str(run.path / STUDENT_DIR),
              "task": "language_modeling", "eval_split": recipe.eval.split, "primary_metric": "perplexity",
              "metrics": metrics, "metrics_before_training": {}, "method": "zero_shot", "student": description,
              "privacy": claim, "privacy_claim": claim, "model_dir": str(run.path / STUDENT_DIR),
              "teacher_run": teacher["privacy"]["teacher_run"] if teacher else None,
              "seconds": time.monotonic() - started}
    run.save_result(result, [])  # the zero-shot student is the public model itself
    return result


def run_distill(recipe: Any = None, out: str | Path | None = None, resume: str | Path | None = None,
                output: Any = None) -> dict[str, Any]:
    """Train and score the student of ``recipe.distill`` in its run directory; ``resume`` continues one."""
    output = output or Output(quiet=True)
    if resume is None:
        if recipe is None:
            raise UserError("Give a distill recipe, or --resume RUN_DIR to continue a run.")
        check_recipe(recipe)
        if recipe.distill.method == "zero_shot":
            return run_zero_shot(recipe, out, output)
        method = recipe.distill.method
        if method in SYNTHETIC_METHODS:
            output.info(f"{method}: the student trains WITHOUT DP on DP synthetic data (and DP teacher outputs); "
                        "its ε is the teacher's (plus the code histogram's).")
    return run_finetune(recipe, out=out, resume=resume, output=output, build=build_student_training)
