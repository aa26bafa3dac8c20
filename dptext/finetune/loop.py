"""The training loop, readable top to bottom (nanoGPT style).

Each logical step takes one batch of indices from the sampler (Poisson: its size varies and may
be 0), runs it in physical micro-batches, and makes one optimizer step: for a private run the
engine clips every example (every user's examples together under privacy.unit=user: micro-batches
are split between users, never inside one), adds noise once and divides by the expected batch
size; the ledger records the step. Checkpoints (``dptext.finetune.checkpointing``) hold everything needed to
continue bit for bit. Ctrl-C stops the loop after the current step (``dptext.finetune.interrupts``).
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

import torch

from dptext.errors import RunInterrupted, UserError
from dptext.finetune import sharding
from dptext.finetune.checkpointing import save_checkpoint
from dptext.finetune.interrupts import ctrl_c_deferred
from dptext.finetune.lr_schedule import set_learning_rate
from dptext.finetune.selection import save_best
from dptext.finetune.user_level import micro_batches_by_user, shortest_users_first
from dptext.privacy.sampling.user_sampler import UserBatch
from dptext.runs import RunDir


class NonFiniteError(UserError):
    """Training produced a NaN or infinite loss or weight; the run stops instead of reporting garbage."""


def micro_batches(indices: list[int], size: int):
    for start in range(0, len(indices), size):
        yield indices[start:start + size]


def shortest_first(examples: Any, indices: list[int]) -> list[int]:
    """The sampled rows ordered by length (a stable sort) before they are cut into micro-batches.

    A micro-batch pads to its longest row: SST-2 batches of 1,000 cut in sampled order into micro-batches of 50 pad
    to 3.2x the real tokens, sorted to 1.1x. The step's clipped sum (and the non-private mean) does not depend on
    which micro-batch a row is in, so the order changes the cost, not the result."""
    return sorted(indices, key=lambda i: len(examples[i].input_ids))


def _autocast(training: Any):
    if training.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(training.device.type, dtype=training.autocast_dtype)


def chunks_of(training: Any, indices: list[int], users: list[int] | None):
    """(rows, their users or None) per micro-batch; with users, micro-batches are split between users, never
    inside one, so each user's rows reach the engine in one accumulate call and are clipped together."""
    if users is not None:
        lengths = [len(training.examples[i].input_ids) for i in indices]
        return micro_batches_by_user(*shortest_users_first(lengths, indices, users), training.physical_batch_size)
    ordered = shortest_first(training.examples, indices)
    chunks = sharding.same_count_on_every_rank(training, micro_batches(ordered, training.physical_batch_size))
    return ((chunk, None) for chunk in chunks)


def train_step(training: Any, sampled: Any) -> tuple[float | None, int]:
    """One logical step on a batch of example indices, or a ``UserBatch`` (indices and the user of each): (their
    mean loss or None for an empty batch, batch size in examples).

    Distributed, both are over every rank's examples (``indices`` are this rank's share)."""
    indices, users = (sampled.indices, sampled.users) if isinstance(sampled, UserBatch) else (sampled, None)
    total, count = 0.0, 0
    distributed = training.dist is not None and training.dist.active
    # eDP-SGD clips whole micro-batches: its units are the sampled examples of each fixed slot
    # (dptext.privacy.mechanisms.edp)
    units = getattr(training.engine, "clipping_units", None)
    for unit in units(indices) if units else [indices]:
        for chunk, owners in chunks_of(training, unit, users):
            if not chunk:  # FSDP2: this rank has fewer micro-batches than another; it joins their collectives
                sharding.empty_pass(training, _autocast(training))
                continue
            batch = {k: v.to(training.device)
                     for k, v in training.task.collate([training.examples[i] for i in chunk]).items()}
            with _autocast(training):
                losses = training.task.per_example_loss(training.model, batch)
            if training.private:
                if owners is None:  # (eDP-SGD's engine takes no units)
                    training.engine.accumulate(losses)
                else:
                    training.engine.accumulate(losses, units=torch.tensor(owners))
            elif distributed:  # summed here, averaged over every rank's examples below
                losses.float().sum().backward()
            else:  # non-private baseline: the mean over the realised batch, as ordinary training does
                (losses.float().sum() / len(indices)).backward()
            total += losses.detach().float().sum().item()
            count += len(chunk)
        if units:
            training.engine.close_unit()
    if not math.isfinite(total) and not distributed:  # before the step: the weights are still the last finite ones
        raise NonFiniteError("loss")  # (under torchrun the weight check after the step stops every rank alike)
    if training.private:
        training.engine.step()  # an empty batch still takes a (noise-only) step and is accounted
    elif distributed:
        params = [p for group in training.optimizer.param_groups for p in group["params"]]
        if training.dist.average_gradients(params, len(indices)):
            training.optimizer.step()
        training.optimizer.zero_grad(set_to_none=True)
    elif indices:
        training.optimizer.step()
        training.optimizer.zero_grad(set_to_none=True)
    if distributed:  # the logged loss is the mean over every rank's examples
        total, count = training.dist.sum_floats(total, count)
    return (total / count if count else None), int(count)


def weights_finite(training: Any) -> bool:
    """Whether every trainable weight is finite (a NaN gradient or an overflow shows up here after the step)."""
    if sharding.is_sharded(training):
        return sharding.weights_finite(training)
    return all(bool(torch.isfinite(p).all()) for p in training.model.parameters() if p.requires_grad)


def stop_non_finite(training: Any, run: RunDir, step: int, what: str, checkpoint: bool) -> None:
    """Stop with one sentence; keep the last finite state as a checkpoint when the weights still hold it."""
    latest = run.latest_checkpoint()
    if checkpoint and (latest is None or latest.name != f"step-{step - 1:08d}.pt"):
        save_checkpoint(training, run, step - 1)
        latest = run.latest_checkpoint()
    kept = (f"the last finite state is {latest}" if latest is not None
            else "no checkpoint holds a finite state")
    raise NonFiniteError(f"Training stopped at step {step}: a {what} became NaN or infinite ({kept}); lower "
                         "train.learning_rate or check privacy.max_grad_norm and the data, then start a new run.")


def epsilon_spent(training: Any) -> float | None:
    return training.ledger.epsilon_spent() if training.private else None


def validate(training: Any, run: RunDir, step: int, evaluate: Any) -> bool:
    """A periodic evaluation on the validation split; with model selection, also the best weights and a
    checkpoint (so the selection state on disk always matches best.pt). True when it checkpointed."""
    scores = evaluate(training.eval_records)
    run.log_metrics({"step": step, "split": "validation", **scores})
    selection = training.selection
    if selection is None:
        return False
    if selection.observe(scores, step):
        save_best(run, training.model, selection)
    save_checkpoint(training, run, step)
    return True


def log_clock(run: RunDir, step: int, loss: float, batch_size: int, started: float, **extra: Any) -> dict[str, Any]:
    """Log a step's exact loss, realised batch size and the invocation's clock so far (diagnostics: not covered)."""
    record = {"step": step, "loss": loss, "batch_size": batch_size, "seconds": time.monotonic() - started, **extra}
    run.log_diagnostics(record)
    return record


def run_loop(training: Any, run: RunDir, output: Any, start_step: int,
             evaluate: Any) -> tuple[dict[str, Any], int]:
    """Train from ``start_step`` to the planned number of steps, or until early stopping.

    Returns the last logged record and the step reached."""
    cfg = training.recipe.train
    steps = training.plan.steps
    selection = training.selection
    started = time.monotonic()
    record: dict[str, Any] = {}
    step = saved = start_step
    if selection is not None and selection.should_stop:  # resumed after the stop decision was checkpointed
        return record, step
    with output.progress(steps, "training", start=start_step) as progress, \
            ctrl_c_deferred(training.dist is None or not training.dist.active) as stop:
        for step, sampled in enumerate(training.sampler, start=start_step + 1):
            set_learning_rate(training, step)
            try:
                loss, batch_size = train_step(training, sampled)
            except NonFiniteError:
                stop_non_finite(training, run, step, "loss", checkpoint=step - 1 > start_step)
            if not weights_finite(training):
                stop_non_finite(training, run, step, "weight", checkpoint=False)
            eps = epsilon_spent(training)
            progress.advance(1, loss=loss, eps=eps)
            if step % cfg.log_every == 0 or step == steps:
                # ε depends on the settings alone (covered); the exact loss, the realised Poisson batch size and
                # the time it took are un-noised statistics of the private batch: a separate, not-covered file
                run.log_metrics({"step": step, "epoch": step / training.plan.steps_per_epoch, "epsilon": eps})
                record = log_clock(run, step, loss, batch_size, started)
            due = cfg.eval_every and (step % cfg.eval_every == 0 or step == steps)
            if due and (step != steps or selection is not None):  # with selection the last step may be the best
                if validate(training, run, step, evaluate):
                    saved = step
                if selection is not None and selection.should_stop:
                    output.info(f"Early stop at step {step}: no better validation {selection.metric} in "
                                f"{selection.patience} evaluations (best {selection.best_value:.4g} at step "
                                f"{selection.best_step}).")
                    break
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step != steps:
                save_checkpoint(training, run, step)
                saved = step
            if stop.requested and step != steps:  # Ctrl-C: the step is finished; keep it and say how to go on
                if record.get("step") != step:  # the kept steps since the last log line took time a resumed
                    # run's wall clock (summed over invocations from these records) must not lose
                    log_clock(run, step, loss, batch_size, started, interrupted=True)
                if saved != step:
                    save_checkpoint(training, run, step)
                raise RunInterrupted(run.path, step)
    if step > saved:
        save_checkpoint(training, run, step)
    if stop.requested:  # Ctrl-C during the last step (or the one that stopped early): kept, never lost
        raise RunInterrupted(run.path, step)
    return record, step
