"""``run_finetune``: one fine-tuning run from recipe to result, in its run directory.

What the CLI calls and tests call. A run writes resolved.yaml and provenance.json first, then
metrics.jsonl (ε spent) and diagnostics_not_private.jsonl (exact losses, realised batch sizes) as it
trains, checkpoints and ledger.json, the final evaluation's finished batches (final_evaluation.jsonl, so
an evaluation cut off resumes too), the trained model in ``model/``, finally result.json and release.json
(the release status of every file, ``dptext.release``). ``resume=RUN_DIR`` reopens such a directory and continues from
its newest complete checkpoint with the same recipe, the same samples, the same noise and the same privacy
account.

Under ``torchrun`` (see ``dptext.finetune.distributed``) every rank calls this; rank 0 alone writes the run
directory, evaluates and returns the result, the others return ``{"follower": True, "rank": r, "run_dir": ...}``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from dptext.accounting import epsilon_unit
from dptext.accounting.plan import delta_warning
from dptext.data.audit_split import write_audit
from dptext.errors import UserError
from dptext.finetune import selection as model_selection
from dptext.finetune import sharding
from dptext.finetune.baseline import baseline_summary
from dptext.finetune.curve import maybe_write_curve
from dptext.finetune.distributed import FollowerRun, current, release, silent_output
from dptext.finetune.checkpointing import check_same_account, restore
from dptext.finetune.interrupts import (ctrl_c_deferred, stop_if_requested_before_training, 
                                      stopped_at_once)
from dptext.finetune.loop import run_loop
from dptext.finetune.setup import build_training
from dptext.finetune.user_level import (check_single_process, evaluation_users, training_counts, unit_summary,
                                       user_level, user_unit_text)
from dptext.finetune.validate import validate_run
from dptext.output import Output
from dptext.finetune.start_model import start_model_flags, start_model_source
from dptext.release import ORIGIN, inherited_flags, recipe_flags, recipe_unit
from dptext.runs import (FINAL_EVALUATION, MODEL_DIR, RunDir, atomic_directory, atomic_write_json, origin,
                         write_manifest)
from dptext.tasks.eval_journal import EvaluationJournal, records_digest, weights_digest


def _evaluator(training: Any, output: Any):
    def evaluate(records: list, journal: EvaluationJournal | None = None) -> dict[str, float]:
        if not records or (training.dist is not None and not training.dist.is_writer  # rank 0 evaluates (all
                           and not training.dist.sharded):  # ranks when sharded: each forward gathers weights)
            return {}
        task = training.task
        with output.progress(task.evaluation_size(records), "evaluating") as progress:
            return task.evaluate(training.model, records, batch_size=training.recipe.eval.batch_size,
                                 on_progress=progress.advance, journal=journal)
    return evaluate


def final_journal(training: Any, run: RunDir, step: int) -> EvaluationJournal | None:
    """The final evaluation's journal (``dptext.tasks.eval_journal``): a run cut off while it evaluates resumes
    with the batches already done. One process only: sharded ranks evaluate together and write nothing."""
    if (not training.final_records or not training.task.journals_evaluation
            or (training.dist is not None and training.dist.active)):
        return None
    recipe = training.recipe
    identity = {"step": step, "split": recipe.eval.split, "weights": weights_digest(training.model),
                "records": records_digest(training.final_records), "eval": dataclasses.asdict(recipe.eval)}
    return EvaluationJournal(run.path / FINAL_EVALUATION, identity)


def save_model(training: Any, run: RunDir, full_state: dict | None = None) -> Path:
    """The trained model and tokenizer as a HF folder (atomically: temp folder, then rename); ``full_state``: the
    gathered weights of a sharded model (``sharding.full_state_dict``)."""
    target = run.path / MODEL_DIR
    with atomic_directory(target) as staging, sharding.as_unsharded_class(training.model) as model:
        model.save_pretrained(staging, **({"state_dict": full_state} if full_state is not None else {}))
        training.tokenizer.save_pretrained(staging)
        # its marker from the start: a run cut off before save_result leaves no model/ a copy of which says nothing
        (staging / Path(ORIGIN).name).write_text(json.dumps(origin(release_flags(training))) + "\n")
    return target


DIALOG_UNIT = ("one message (a record: the response with the dialog so far as its prompt); a message also sits "
               "in the history of every later record of its dialog, so one message, a whole dialog or one speaker "
               "is covered only by group privacy over the records it appears in (about (k+1)·ε for k later turns)")


def privacy_unit(recipe: Any) -> str:
    """What one unit of the DP guarantee is for this recipe (what add/remove-one changes)."""
    if user_level(recipe):
        return user_unit_text(recipe.privacy.max_examples_per_user)
    return DIALOG_UNIT if recipe.task.type == "dialog" else "one training record (one line / example of the data)"


def privacy_summary(training: Any) -> dict[str, Any]:
    recipe, plan = training.recipe, training.plan
    summary = {"private": training.private, "steps": plan.steps, "sample_rate": plan.sample_rate,
               "expected_batch_size": plan.sample_rate * plan.dataset_size, "dataset_size": plan.dataset_size,
               "counted": "examples" if training.users is None else "users",  # what q, n and the batch count
               "privacy_unit": privacy_unit(recipe), **unit_summary(recipe, training.users)}
    if not training.private:
        return {**summary, "note": "non-private baseline: no clipping, no noise, no privacy guarantee"}
    return {**summary, "noise_multiplier": training.noise_multiplier,
            "max_grad_norm": recipe.privacy.max_grad_norm, "delta": plan.delta, "delta_source": plan.delta_source,
            "accountant": recipe.privacy.accountant, "target_epsilon": recipe.privacy.target_epsilon,
            "sampling": recipe.privacy.sampling, "clipping_mode": recipe.privacy.clipping_mode,
            "epsilon": {r.method: r.to_dict() for r in training.ledger.report()},
            "method": recipe.privacy.method, "mechanism": training.engine.mechanism(),
            "noise_schedule": [{"noise_multiplier": r.noise_multiplier, "steps": r.steps}
                               for r in training.ledger.runs]}


def release_flags(training: Any) -> list[str]:
    """Why the run's outputs might lack the DP guarantee (``dptext.release.FLAG_REASONS``): its own settings,
    and those of a teacher whose outputs it learnt from (distillation)."""
    claim = training.info.get("privacy_claim") or {}
    if not (training.private or claim.get("private")):
        return ["non_private"]
    flags = recipe_flags(training.recipe) if training.private else []
    if claim.get("code_distribution", {}).get("mechanism") == "exact":
        flags.append("exact_codes")
    carried = inherited_flags((claim.get("teacher") or {}).get("teacher_run"))
    return list(dict.fromkeys(flags + carried + training.start_flags))


def run_finetune(recipe: Any = None, out: str | Path | None = None, resume: str | Path | None = None,
                 output: Any = None, build: Any = None) -> dict[str, Any]:
    """``build(recipe, run) -> Training`` replaces ``build_training`` (``dptext distill`` builds its student
    run this way); keys of its ``training.info`` override those of the result (e.g. ``privacy``)."""
    output = output or Output(quiet=True)
    # Ctrl-C only raises a flag until training ends, looked at once the model has loaded and after every step
    with ctrl_c_deferred(int(os.environ.get("WORLD_SIZE", "1")) <= 1) as stop:
        try:
            trained = _train(recipe, out, resume, output, build, stop)
        except KeyboardInterrupt as error:  # a second Ctrl-C: say whether a checkpoint can continue the run
            stopped = stopped_at_once(error, stop)
            if stopped is error:
                raise
            raise stopped from None
    # from here Ctrl-C stops at once: the last step is checkpointed and the final evaluation keeps a journal
    return trained if isinstance(trained, dict) else _finish(*trained)


def _train(recipe: Any, out: Any, resume: Any, output: Any, build: Any, stop: Any) -> Any:
    """The run up to its last training step: a dict for a run that needs nothing more (finished before, or a
    follower rank's), else what ``_finish`` takes."""
    if resume is not None:
        if out is not None and Path(out).resolve() != Path(resume).resolve():
            raise UserError(f"--resume continues the run in '{resume}' where it is; drop --out '{out}' (to train "
                            "into another folder, start a new run there).")
        run = RunDir.open(resume)
        # torchrun: rank 0 alone locks, which suffices: the other ranks write into the folder only FSDP2's
        # checkpoint shards, inside collectives rank 0 joins after this (the ranks first meet in current()'s
        # init_process_group; for a new run they wait for rank 0 to broadcast the folder it has locked)
        if os.environ.get("RANK", "0") == "0":
            run.lock()
        finished = run.load_result()
        if finished is not None:
            if os.environ.get("RANK", "0") != "0":  # torchrun: rank 0 reports it
                return {"follower": True, "rank": int(os.environ["RANK"]), "run_dir": str(run.path)}
            output.info(f"Run {run.path} already finished; its result is below.")
            return finished
        recipe = run.recipe()
    elif recipe is None:
        raise UserError("Give a recipe to fine-tune, or --resume RUN_DIR to continue a run.")
    validate_run(recipe, out, check_out=resume is None, check_model=build is None)  # before anything is written
    dist = current(recipe.train.device)  # torchrun: one process per device; rank 0 alone writes the run directory
    check_single_process(recipe, dist.active)
    existed = out is not None and Path(out).is_dir()
    if resume is None:
        if dist.is_writer:
            run = RunDir.create(recipe, out)
            dist.broadcast(str(run.path))  # the other ranks learn the (timestamped) directory's name
        else:
            run = FollowerRun(dist.broadcast(None))
    if not dist.is_writer:
        run, output = FollowerRun(run.path), silent_output()
    stop.run = run
    started = time.monotonic()
    try:
        training = build(recipe, run) if build is not None else build_training(recipe)
        training.start_flags = start_model_flags(training.recipe.model.name)  # as loaded (it may go before the end)
    except BaseException:  # a failed start leaves nothing (a kill here leaves a folder --resume or a re-run takes over)
        if resume is None and dist.is_writer:
            run.remove_unstarted(keep_folder=existed)
        raise
    stop_if_requested_before_training(stop, run, resumed=resume is not None, keep_folder=existed)
    output.info(f"Run directory: {run.path}")  # only once it exists for good: a refused start removes it
    state = run.load_checkpoint(say=output.warn) if resume is not None else None
    if training.users is not None and dist.is_writer:  # release.json says what evaluation holds (a public rule)
        write_manifest(run.path, unit={**recipe_unit(recipe), "evaluation_users": evaluation_users(recipe)})
        if state is None:  # exact counts of users and records: not in covered files
            run.log_diagnostics(training_counts(training.users))
    if training.split_copies and resume is None and dist.is_writer:
        warn_split_copies(training, run, output)
    if state is not None:
        check_same_account(training, state)
    training.selection = model_selection.make_selection(recipe, training.task, dist.active)
    # who is (not) a member, for `dptext mia`; same seed on resume, same split
    if training.audit is not None and dist.is_writer:
        write_audit(run.path, training.audit, trained_on=len(training.examples))
    if training.mf_strategy is not None and dist.is_writer:  # banded MF: a function of the recipe and n only
        atomic_write_json(run.path / "mf_strategy.json", training.mf_strategy)
    evaluate = _evaluator(training, output)
    start_step = restore(training, state, run.checkpoint_dir) if state is not None else 0
    if state is not None:
        run.truncate_metrics_after(start_step)
        output.info(f"Resuming at step {start_step} of {training.plan.steps}.")
    _announce(training, output, run if state is None and dist.is_writer else None)

    before = {}
    if recipe.eval.before_training and start_step == 0:
        before = evaluate(training.final_records)
        run.log_metrics({"step": 0, "split": recipe.eval.split, "before_training": True, **before})
    _, steps_run = run_loop(training, run, output, start_step, evaluate)
    return training, run, dist, evaluate, started, start_step, before, steps_run


def _finish(training: Any, run: Any, dist: Any, evaluate: Any, started: float, start_step: int, before: dict,
            steps_run: int) -> dict[str, Any]:
    """After the last step: the best weights, the final evaluation, the model, result.json and release.json."""
    recipe = training.recipe
    if training.selection is not None and recipe.train.keep_best:
        model_selection.restore_best(run, training.model, training.selection)
    journal = final_journal(training, run, steps_run)
    final = evaluate(training.final_records, journal)
    run.log_metrics({"step": steps_run, "split": recipe.eval.split, **final})
    full_state = sharding.full_state_dict(training)  # FSDP2: every rank sends its shards to rank 0
    if not dist.is_writer:
        release()
        return {"follower": True, "rank": dist.rank, "run_dir": str(run.path)}
    model_dir = save_model(training, run, full_state)
    result = {
        "run_dir": str(run.path), "recipe": recipe.name, "model": recipe.model.name, "task": recipe.task.type,
        "eval_split": recipe.eval.split, "primary_metric": training.task.primary_metric,
        "metrics": final, "metrics_before_training": before,
        "privacy": privacy_summary(training), "model_dir": str(model_dir),
        "physical_batch_size": training.physical_batch_size, "steps_run": steps_run,
        **model_selection.summary(training.selection, steps_run), **training.info, **baseline_summary(recipe),
    }
    seconds = time.monotonic() - started
    # The run's wall time is an un-noised function of the realised Poisson batch sizes and of the sampled records'
    # lengths, like the per-step clock, so it goes to the not-covered diagnostics, not into the covered result.json.
    # start_step: where this invocation began, so a collector can tell an invocation that only evaluated (resumed
    # at the last step) from one that trained, and add the earlier invocations' time to the wall time; with the
    # seconds an earlier invocation spent on the evaluation batches this one took from the journal
    run.log_diagnostics({"event": "finished", "step": steps_run, "start_step": start_step, "total_seconds": seconds,
                         "evaluation_reused_seconds": journal.reused_seconds if journal is not None else 0.0})
    maybe_write_curve(training, run)  # before release.json, which lists it
    run.save_result(result, release_flags(training))
    release()
    return {**result, "seconds": seconds}


def warn_split_copies(training: Any, run: RunDir, output: Any) -> None:
    """Duplicated rows on both sides of the split: said once, and kept with the not-covered diagnostics (the count
    is an un-noised statistic of the private data)."""
    split, copies = training.recipe.eval.split, training.split_copies
    output.warn(f"{copies} of the {len(training.final_records)} {split} records have a word-for-word copy in the "
                f"training split (duplicated rows), so the {split} metrics overstate how the model does on new "
                "text; deduplicate the data (this count is not covered by ε; diagnostics_not_private.jsonl keeps it).")
    run.log_diagnostics({"event": "split_copies", "step": 0, "split": split, "copies": copies})


def _announce(training: Any, output: Any, run: Any = None) -> None:
    """The run's plan in one line, and a large δ's warning (when δ ≥ 1/n also kept, with n and δ, in ``run``'s
    not-covered diagnostics: n is an exact count of the private data)."""
    plan, recipe = training.plan, training.recipe
    counted = "" if training.users is None else " users"
    line = (f"{recipe.model.name} on {recipe.data.dataset}: n={plan.dataset_size}{counted}, "
            f"q={plan.sample_rate:.4g}, {plan.steps} steps, micro-batch {training.physical_batch_size}")
    if training.private:
        target = recipe.privacy.target_epsilon
        sigma = "σ pinned by privacy.noise_multiplier, ε" if target is None else f"target ε={target:g}"
        line += (f"; DP with σ={training.noise_multiplier:.4g}, C={recipe.privacy.max_grad_norm:g}, "
                 f"δ={plan.delta:.3g} ({plan.delta_source}), {sigma} {epsilon_unit(training.ledger.mechanism)}")
    elif training.info.get("privacy_claim"):  # distillation from DP data: post-processing, the claim is inherited
        line += "; trains without noise on DP-derived data (the privacy claim is inherited, see the summary)"
    else:
        line += "; NON-PRIVATE baseline (privacy.enabled=false)"
    output.info(line)
    warning = delta_warning(plan.delta, plan.delta_source, plan.dataset_size) if training.private else None
    if warning:
        output.warn(warning)
        if run is not None and plan.delta * plan.dataset_size >= 1:  # δ ≥ 1/n: n and δ kept with the run
            run.log_diagnostics({"event": "delta_warning", "step": 0, "n": plan.dataset_size, "delta": plan.delta,
                                 "warning": warning})
    start = start_model_source(recipe.model.name)
    if start is not None:
        output.warn(f"model.name is a model dptext trained ({start}): this run's ε covers only its own training; "
                    "what the start model learnt keeps its own ε and flags (carried into this run's release.json), "
                    "and where both trained on the same records their ε compose.")
    if training.private and (recipe.task.type == "dialog" or training.users is not None):
        output.info(f"Privacy unit: {privacy_unit(recipe)}.")
