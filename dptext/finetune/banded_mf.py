"""The banded matrix-factorization side of ``build_training`` (``privacy.mechanism: banded_mf``, SPEC §12).

The recipe's batch size B gives P = round(n/B) cyclic bins (the steps per epoch) and S steps give k = ⌈S/P⌉
participations; the b-banded Toeplitz strategy is optimised for (n steps, b, k, P) on the CPU at start-up
(``accounting.mf_strategy``, seconds) and scaled to sensitivity 1, so σ is the multiplier of the one Gaussian
mechanism the run is: calibrated to the target ε by the recipe's accountant at q = 1, one step. The coefficients
depend only on the recipe and n, and are written to the run directory (mf_strategy.json).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from dptext.accounting import PrivacyLedger, calibrate_noise_multiplier
from dptext.accounting.banded_mf import Participation
from dptext.accounting.mf_strategy import optimize_banded
from dptext.errors import UserError
from dptext.finetune.seeds import privacy_seed
from dptext.finetune.task_probe import verify_with_task
from dptext.privacy.mf_engine import POISSON_REFUSED, BandedMFEngine


def check_banded_mf(privacy: Any, bins: int) -> None:
    """Refuse, before any work, what the banded MF accounting does not cover (each in one sentence)."""
    if privacy.sampling != "cyclic":
        raise UserError(POISSON_REFUSED.replace("sampling='cyclic'", "privacy.sampling=cyclic"))
    if privacy.method != "dp_sgd":
        raise UserError("privacy.mechanism=banded_mf replaces DP-SGD's noise, not eDP-SGD's; use "
                        "privacy.method=dp_sgd with it.")
    if privacy.unit != "example":
        raise UserError("User-level DP with banded MF noise is not accounted yet; use privacy.unit=example.")
    if privacy.mf_bands > bins:
        raise UserError(f"privacy.mf_bands={privacy.mf_bands} exceeds the {bins} steps per epoch (the cyclic "
                        "separation), where the sensitivity is not proven; lower mf_bands or train.batch_size.")


def mf_noise_multiplier(privacy: Any, delta: float) -> float:
    """σ of the one Gaussian mechanism (sensitivity 1): pinned, or calibrated at q = 1, one step."""
    if privacy.noise_multiplier is not None:
        return privacy.noise_multiplier
    if privacy.target_epsilon is None:
        raise UserError("Set privacy.target_epsilon (or privacy.noise_multiplier) for a banded MF run.")
    return calibrate_noise_multiplier(privacy.target_epsilon, delta, 1.0, 1, method=privacy.accountant
                                      ).noise_multiplier


def build_banded_mf(training: Any, dist: Any, probe_now: bool = True) -> None:
    """Set ``training``'s strategy, noise multiplier, ledger, banded MF engine and cyclic sampler."""
    recipe, plan = training.recipe, training.plan
    privacy = recipe.privacy
    bins = plan.steps_per_epoch
    check_banded_mf(privacy, bins)
    n = len(training.examples)
    strategy = optimize_banded(plan.steps, privacy.mf_bands, Participation(math.ceil(plan.steps / bins), bins))
    training.noise_multiplier = mf_noise_multiplier(privacy, plan.delta)
    training.plan = replace(plan, sample_rate=1.0 / bins)  # each step trains one bin: the rate the ledger records
    training.ledger = PrivacyLedger(delta=plan.delta, dataset_size=n, accountant=privacy.accountant,
                                    delta_source=plan.delta_source)
    training.engine = BandedMFEngine(
        training.model, training.optimizer, noise_multiplier=training.noise_multiplier,
        max_grad_norm=privacy.max_grad_norm, dataset_size=n, steps=plan.steps, bins=bins,
        coefficients=list(strategy.coefficients), sampling=privacy.sampling, clipping_mode=privacy.clipping_mode,
        clipping_layout=privacy.clipping_layout, seed=privacy_seed(privacy, recipe.train.seed),
        secure_rng=privacy.secure_rng, ledger=training.ledger.record_step, distributed=dist, verify=privacy.verify)
    training.ledger.mechanism = training.engine.mechanism()
    if privacy.verify and probe_now:
        verify_with_task(training.engine, training.task, training.model)
    training.sampler = training.engine.sampler(plan.steps)
    training.mf_strategy = strategy.to_dict()
