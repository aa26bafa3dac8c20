"""Checkpoints of a fine-tuning run: what one holds, how a freshly built training is put back, and the check that a
resumed run continues the same privacy account.

A checkpoint holds everything needed to continue bit for bit: parameters (or, under FSDP2, the name of the sharded
weights each rank wrote), optimizer moments, the sampler's and the noise's generators, the global RNGs, the engine's
state and the ledger. ``dptext.runs.RunDir.save_checkpoint`` writes it atomically with its checksum.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dptext.accounting import PrivacyLedger
from dptext.errors import UserError
from dptext.finetune import sharded_checkpoint, sharding
from dptext.finetune.seeds import capture_rng_state, restore_rng_state
from dptext.runs import RunDir


def checkpoint_state(training: Any, step: int, checkpoints: Path | None = None) -> dict[str, Any]:
    """``checkpoints``: the folder that FSDP2's sharded weights are written to (every rank writes its shard)."""
    if sharding.is_sharded(training):
        state: dict[str, Any] = {"sharded_weights": sharded_checkpoint.save_weights(training, checkpoints, step)}
    else:
        state = {"model": training.model.state_dict(), "optimizer": training.optimizer.state_dict()}
    state.update({
        # per rank when distributed (a list indexed by rank, gathered to rank 0, which alone writes)
        "sampler": _gather(training, training.sampler.generator.get_state()),
        "rng": _gather(training, capture_rng_state()),
    })
    if training.private:
        state["engine"] = training.engine.state_dict()
        state["ledger"] = training.ledger.to_dict(with_epsilon=False)
    if training.selection is not None:
        state["selection"] = training.selection.state_dict()
    return state


def restore(training: Any, state: dict[str, Any], checkpoints: Path | None = None) -> int:
    """Put a freshly built training back where the checkpoint left it; returns the step reached."""
    if "sharded_weights" in state:
        sharded_checkpoint.load_weights(training, checkpoints, state["sharded_weights"])
    else:
        training.model.load_state_dict(state["model"])
        training.optimizer.load_state_dict(state["optimizer"])
    training.sampler.generator.set_state(_mine(training, state["sampler"]))
    training.sampler.steps = training.plan.steps - state["step"]
    if training.private:
        training.engine.load_state_dict(state["engine"])
        restored = PrivacyLedger.from_dict(state["ledger"])
        for run in restored.runs:  # continue the same account: the engine appends to this ledger object
            training.ledger.record_steps(run.sample_rate, run.noise_multiplier, run.steps)
    if training.selection is not None and "selection" in state:
        training.selection.load_state_dict(state["selection"])
    restore_rng_state(_mine(training, state["rng"]))
    return state["step"]


def check_same_account(training: Any, state: dict[str, Any]) -> None:
    """A resumed run rebuilds its plan from the data as it is now; if the training set's size changed since the
    run started, q and δ = 1/(2n) (and σ, calibrated from them) would change mid-account without a word. Refused
    before the resumed run writes anything, so the account it continues is the one it started."""
    if not training.private:
        return
    restored, now = PrivacyLedger.from_dict(state["ledger"]), training.ledger
    changes = []
    if restored.dataset_size != now.dataset_size:
        changes.append(f"n {restored.dataset_size} -> {now.dataset_size}")
    if not math.isclose(restored.delta, now.delta, rel_tol=1e-9):
        changes.append(f"δ {restored.delta:.3g} -> {now.delta:.3g}")
    rates = {run.sample_rate for run in restored.runs}
    if any(not math.isclose(rate, training.plan.sample_rate, rel_tol=1e-9) for rate in rates):
        changes.append(f"q {', '.join(f'{r:.4g}' for r in sorted(rates))} -> {training.plan.sample_rate:.4g}")
    for key, what in (("method", "mechanism"), ("unit", "privacy unit")):  # e.g. DP-SGD's ledger resumed as BLT
        before, after = (restored.mechanism or {}).get(key), (now.mechanism or {}).get(key)
        if before is not None and after is not None and before != after:
            changes.append(f"{what} {before} -> {after}")
    if restored.accountant != now.accountant:
        changes.append(f"accountant {restored.accountant} -> {now.accountant}")
    sigmas = {run.noise_multiplier for run in restored.runs}
    constant = training.recipe.privacy.method != "edp_sgd"  # eDP-SGD's σ follows its schedule step by step
    if constant and any(not math.isclose(s, training.noise_multiplier, rel_tol=1e-9) for s in sigmas):
        # e.g. a DPKD student's σ, calibrated to its share of the budget, after its teacher's ε was re-read
        changes.append(f"σ {', '.join(f'{s:.4g}' for s in sorted(sigmas))} -> {training.noise_multiplier:.4g}")
    if changes:
        raise UserError(f"This run's training data or privacy settings changed since it started ({'; '.join(changes)}"
                        "), so resuming would continue its privacy account under other terms; restore the data it "
                        "started with, or start a new run.")


def _gather(training: Any, value: Any) -> Any:
    return training.dist.gather(value) if training.dist is not None else value


def _mine(training: Any, value: Any) -> Any:
    return training.dist.mine(value) if training.dist is not None else value


def save_checkpoint(training: Any, run: RunDir, step: int) -> None:
    """The ledger first, then the checkpoint and its LATEST pointer: an interruption anywhere in between leaves
    ledger.json at or ahead of every checkpoint on disk, so `dptext account RUN_DIR` never under-reports ε."""
    if training.private:
        run.save_ledger(training.ledger.to_dict())
    run.save_checkpoint(checkpoint_state(training, step, run.checkpoint_dir), step)
