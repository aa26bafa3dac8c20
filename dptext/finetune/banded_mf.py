"""The matrix-factorization side of ``build_training`` (``privacy.mechanism: banded_mf`` or ``blt``, SPEC §12).

The recipe's batch size B gives P = round(n/B) cyclic bins (the steps per epoch) and S steps give k = ⌈S/P⌉
participations; the strategy is optimised for (S steps, k, P) on the CPU at start-up, seconds: a b-banded
Toeplitz C (``accounting.mf_strategy``) or a d-buffer BLT (``accounting.blt_strategy``), and scaled to
sensitivity 1, so σ is the multiplier of the one Gaussian mechanism the run is: calibrated to the target ε by the
recipe's accountant at q = 1, one step. The strategy depends only on the recipe and n, and is written to the run
directory (mf_strategy.json).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from dptext.accounting import PrivacyLedger
from dptext.accounting.calibrate import calibrate_one_mechanism
from dptext.accounting.banded_mf import Participation
from dptext.accounting.blt_strategy import optimize_blt
from dptext.accounting.mf_strategy import optimize_banded
from dptext.errors import UserError
from dptext.finetune.seeds import privacy_seed
from dptext.finetune.sharding import mark_verified, proven_before_sharding
from dptext.finetune.task_probe import verify_with_task
from dptext.privacy.mechanisms.blt import POISSON_REFUSED as BLT_REFUSED
from dptext.privacy.mechanisms.blt import BLTEngine
from dptext.privacy.mechanisms.banded_mf import POISSON_REFUSED, BandedMFEngine


def check_banded_mf(privacy: Any, bins: int) -> None:
    """Refuse, before any work, what the matrix-factorization accounting does not cover (each in one sentence)."""
    refusal, label = (POISSON_REFUSED, "banded MF") if privacy.mechanism == "banded_mf" else (BLT_REFUSED, "BLT")
    if privacy.sampling != "cyclic":
        raise UserError(refusal.replace("sampling='cyclic'", "privacy.sampling=cyclic"))
    if privacy.method != "dp_sgd":
        raise UserError(f"privacy.mechanism={privacy.mechanism} replaces DP-SGD's noise, not eDP-SGD's; use "
                        "privacy.method=dp_sgd with it.")
    if privacy.unit != "example":
        raise UserError(f"User-level DP with {label} noise is not accounted yet; use privacy.unit=example.")
    if privacy.mechanism == "banded_mf" and privacy.mf_bands > bins:
        raise UserError(f"privacy.mf_bands={privacy.mf_bands} exceeds the {bins} steps per epoch (the cyclic "
                        "separation), where the sensitivity is not proven; lower mf_bands or train.batch_size.")


def mf_noise_multiplier(privacy: Any, delta: float) -> float:
    """σ of the one Gaussian mechanism (sensitivity 1): pinned, or calibrated at q = 1, one step."""
    if privacy.noise_multiplier is not None:
        return privacy.noise_multiplier
    if privacy.target_epsilon is None:
        raise UserError("Set privacy.target_epsilon (or privacy.noise_multiplier) for a matrix-factorization run.")
    return calibrate_one_mechanism(privacy.target_epsilon, delta, privacy.accountant).noise_multiplier


def build_banded_mf(training: Any, dist: Any, probe_now: bool = True) -> None:
    """Set ``training``'s strategy, noise multiplier, ledger, correlated-noise engine and cyclic sampler."""
    recipe, plan = training.recipe, training.plan
    privacy = recipe.privacy
    bins = plan.steps_per_epoch
    check_banded_mf(privacy, bins)
    n = len(training.examples)
    schema = Participation(math.ceil(plan.steps / bins), bins)
    if privacy.mechanism == "blt":
        strategy = optimize_blt(plan.steps, privacy.blt_buffers, schema, privacy.blt_error)
        engine_class, chosen = BLTEngine, {"blt": strategy.blt}
    else:
        strategy = optimize_banded(plan.steps, privacy.mf_bands, schema)
        engine_class, chosen = BandedMFEngine, {"coefficients": list(strategy.coefficients)}
    training.noise_multiplier = mf_noise_multiplier(privacy, plan.delta)
    training.plan = replace(plan, sample_rate=1.0 / bins)  # each step trains one bin: the rate the ledger records
    training.ledger = PrivacyLedger(delta=plan.delta, dataset_size=n, accountant=privacy.accountant,
                                    delta_source=plan.delta_source)
    training.engine = engine_class(
        training.model, training.optimizer, noise_multiplier=training.noise_multiplier,
        max_grad_norm=privacy.max_grad_norm, dataset_size=n, steps=plan.steps, bins=bins, **chosen,
        sampling=privacy.sampling, clipping_mode=privacy.clipping_mode, clipping_layout=privacy.clipping_layout,
        seed=privacy_seed(privacy, recipe.train.seed), secure_rng=privacy.secure_rng,
        ledger=training.ledger.record_step, distributed=dist, verify=privacy.verify)
    training.ledger.mechanism = training.engine.mechanism()
    sharded = getattr(dist, "sharded", False)
    if probe_now and sharded and proven_before_sharding(recipe, training.device, training.model):
        # probed on the whole model before fully_shard (weights stored in bf16: prove_then_shard)
        mark_verified(training.engine, training.autocast_dtype)
    elif privacy.verify and probe_now:
        verify_with_task(training.engine, training.task, training.model, training.autocast_dtype)
    training.sampler = training.engine.sampler(plan.steps)
    training.mf_strategy = strategy.to_dict()
