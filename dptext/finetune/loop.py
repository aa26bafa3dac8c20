"""The training loop, readable top to bottom (nanoGPT style).

Each logical step takes one batch of indices from the sampler (Poisson: its size varies and may
be 0), runs it in physical micro-batches, and makes one optimizer step: for a private run the
engine clips every example, adds noise once and divides by the expected batch size; the ledger
records the step. Checkpoints hold everything needed to continue bit for bit: parameters,
optimizer moments, the sampler's and the noise's generators, the global RNGs and the ledger.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from dptext.runs import RunDir, capture_rng_state, restore_rng_state


def micro_batches(indices: list[int], size: int):
    for start in range(0, len(indices), size):
        yield indices[start:start + size]


def _autocast(training: Any):
    import torch

    if training.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(training.device.type, dtype=training.autocast_dtype)


def train_step(training: Any, indices: list[int]) -> tuple[float | None, int]:
    """One logical step on the examples ``indices``: (their mean loss or None for an empty batch, batch size).

    Distributed, both are over every rank's examples (``indices`` are this rank's share)."""
    total, count = 0.0, 0
    distributed = training.dist is not None and training.dist.active
    # eDP-SGD clips whole micro-batches: its units are the sampled examples of each fixed slot (dptext.privacy.edp)
    units = getattr(training.engine, "clipping_units", None)
    for unit in units(indices) if units else [indices]:
        for chunk in micro_batches(unit, training.physical_batch_size):
            batch = {k: v.to(training.device)
                     for k, v in training.task.collate([training.examples[i] for i in chunk]).items()}
            with _autocast(training):
                losses = training.task.per_example_loss(training.model, batch)
            if training.private:
                training.engine.accumulate(losses)
            elif distributed:  # summed here, averaged over every rank's examples below
                losses.float().sum().backward()
            else:  # non-private baseline: the mean over the realised batch, as ordinary training does
                (losses.float().sum() / len(indices)).backward()
            total += losses.detach().float().sum().item()
            count += len(chunk)
        if units:
            training.engine.close_unit()
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


def checkpoint_state(training: Any, step: int) -> dict[str, Any]:
    state = {
        "model": training.model.state_dict(),
        "optimizer": training.optimizer.state_dict(),
        # per rank when distributed (a list indexed by rank, gathered to rank 0, which alone writes)
        "sampler": _gather(training, training.sampler.generator.get_state()),
        "rng": _gather(training, capture_rng_state()),
    }
    if training.private:
        state["engine"] = training.engine.state_dict()
        state["ledger"] = training.ledger.to_dict(with_epsilon=False)
    return state


def restore(training: Any, state: dict[str, Any]) -> int:
    """Put a freshly built training back where the checkpoint left it; returns the step reached."""
    from dptext.accounting import PrivacyLedger

    training.model.load_state_dict(state["model"])
    training.optimizer.load_state_dict(state["optimizer"])
    training.sampler.generator.set_state(_mine(training, state["sampler"]))
    training.sampler.steps = training.plan.steps - state["step"]
    if training.private:
        training.engine.load_state_dict(state["engine"])
        restored = PrivacyLedger.from_dict(state["ledger"])
        for run in restored.runs:  # continue the same account: the engine appends to this ledger object
            training.ledger.record_steps(run.sample_rate, run.noise_multiplier, run.steps)
    restore_rng_state(_mine(training, state["rng"]))
    return state["step"]


def _gather(training: Any, value: Any) -> Any:
    return training.dist.gather(value) if training.dist is not None else value


def _mine(training: Any, value: Any) -> Any:
    return training.dist.mine(value) if training.dist is not None else value


def save_checkpoint(training: Any, run: RunDir, step: int) -> None:
    """The ledger first, then the checkpoint and its LATEST pointer: an interruption anywhere in between leaves
    ledger.json at or ahead of every checkpoint on disk, so `dptext account RUN_DIR` never under-reports ε."""
    if training.private:
        run.save_ledger(training.ledger.to_dict())
    run.save_checkpoint(checkpoint_state(training, step), step)


def epsilon_spent(training: Any) -> float | None:
    return training.ledger.epsilon_spent() if training.private else None


def run_loop(training: Any, run: RunDir, output: Any, start_step: int,
             evaluate: Any) -> dict[str, Any]:
    """Train from ``start_step`` to the planned number of steps; returns the last logged record."""
    cfg = training.recipe.train
    steps = training.plan.steps
    started = time.monotonic()
    record: dict[str, Any] = {}
    with output.progress(steps, "training") as progress:
        progress.advance(start_step)
        for step, indices in enumerate(training.sampler, start=start_step + 1):
            loss, batch_size = train_step(training, indices)
            eps = epsilon_spent(training)
            progress.advance(1, loss=loss, eps=eps)
            if step % cfg.log_every == 0 or step == steps:
                record = {"step": step, "epoch": step / training.plan.steps_per_epoch, "loss": loss,
                          "batch_size": batch_size, "epsilon": eps, "seconds": time.monotonic() - started}
                run.log_metrics(record)
            if cfg.eval_every and step % cfg.eval_every == 0 and step != steps:
                run.log_metrics({"step": step, "split": "validation", **evaluate(training.eval_records)})
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step != steps:
                save_checkpoint(training, run, step)
    if steps > start_step:
        save_checkpoint(training, run, steps)
    return record
