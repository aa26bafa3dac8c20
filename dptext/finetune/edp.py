"""The eDP-SGD side of ``build_training``: noise calibration over the decaying schedule, α, the engine.

z_0 is calibrated so that the whole run — S steps at rate q with σ_t = z_0·d(t)/2 (d the recipe's decay,
t the epoch) — spends the target ε under the recipe's accountant; a pinned ``privacy.noise_multiplier`` is
z_0 itself. See ``dptext.privacy.mechanisms.edp`` for the mechanism and docs/edp.md for what the guarantee means.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from dptext.accounting import PrivacyLedger, calibrate_noise_multiplier
from dptext.accounting.plan import noise_schedule_for
from dptext.data import load_records
from dptext.errors import UserError
from dptext.finetune.seeds import privacy_seed, record_ids
from dptext.finetune.task_probe import verify_with_task
from dptext.privacy.mechanisms.edp import SENSITIVITY_FACTOR, EDPEngine, alphas_from_gradients
from dptext.tasks.base import batches

PROBE_BATCH = 16


def noise_schedule(privacy: Any):
    return noise_schedule_for(privacy)


def accounting_sigma(recipe: Any, plan: Any, factor: int, schedule: Any) -> float:
    """σ_0 the accountant composes (the first epoch's); z_0 = factor·σ_0."""
    privacy = recipe.privacy
    if privacy.noise_multiplier is not None:
        return privacy.noise_multiplier / factor
    if privacy.target_epsilon is None:
        raise UserError("Set privacy.target_epsilon (or privacy.noise_multiplier = z_0), or privacy.enabled=false "
                        "for a non-private baseline.")
    return calibrate_noise_multiplier(privacy.target_epsilon, plan.delta, plan.sample_rate, plan.steps,
                                      method=privacy.accountant, schedule=schedule,
                                      steps_per_epoch=plan.steps_per_epoch).noise_multiplier


def mean_gradient_alphas(training: Any, examples: list) -> dict:
    """α from the gradient of the summed loss of ``examples`` at the current (initial) weights."""
    if not examples:
        raise UserError("eDP-SGD's scaling needs at least one example; raise privacy.edp_public_examples.")
    params = [p for p in training.model.parameters() if p.requires_grad]
    for param in params:
        param.grad = None
    for chunk in batches(examples, PROBE_BATCH):
        batch = {k: v.to(training.device) for k, v in training.task.collate(chunk).items()}
        training.task.per_example_loss(training.model, batch).float().sum().backward()
    grads = {p: (p.grad if p.grad is not None else torch.zeros_like(p)) for p in params}
    alphas = alphas_from_gradients(grads)
    for param in params:
        param.grad = None
    return alphas


def scaling_examples(recipe: Any, training: Any) -> list:
    privacy = recipe.privacy
    if privacy.edp_scaling == "first_step":
        return training.examples[:privacy.edp_public_examples]
    if not privacy.edp_public_path:
        raise UserError("privacy.edp_scaling=public needs privacy.edp_public_path (public examples in the "
                        "training data's format); or use edp_scaling=uniform.")
    data = replace(recipe.data, path=privacy.edp_public_path, max_train_examples=privacy.edp_public_examples)
    public = training.task.encode(load_records(data, "train"))
    private = set(record_ids(training.examples))
    if public and sum(each in private for each in record_ids(public)) * 2 > len(public):
        # validate.py refuses the training data's own path; a copy elsewhere is told by content (most of its
        # examples are training examples; a few equal ones are records of another set)
        raise UserError(f"privacy.edp_public_path '{privacy.edp_public_path}' holds a copy of the private training "
                        "records (most of its examples are training examples), so α measured on it would depend "
                        "on the private data; point it at public examples, or say so with edp_scaling=first_step "
                        "(not covered by ε).")
    return public


def build_edp(training: Any, dist: Any, probe_now: bool = True) -> None:
    """Set ``training``'s noise multiplier (σ_0 as accounted), ledger, eDP engine and sampler."""
    recipe, plan = training.recipe, training.plan
    privacy = recipe.privacy
    if privacy.sampling != "poisson":
        raise UserError("eDP-SGD's micro-batch slots are Poisson-sampled; use privacy.sampling=poisson.")
    n = len(training.examples)
    factor = SENSITIVITY_FACTOR  # public: never a function of n (dptext.privacy.mechanisms.edp)
    schedule = noise_schedule(privacy)
    sigma0 = accounting_sigma(recipe, plan, factor, schedule)
    alphas = None
    if privacy.edp_scaling != "uniform":
        alphas = mean_gradient_alphas(training, scaling_examples(recipe, training))
        if dist is not None:  # every rank must scale alike; rank 0's measurement is the one used
            alphas = dict(zip(alphas, dist.broadcast(list(alphas.values()))))
    training.noise_multiplier = sigma0
    training.ledger = PrivacyLedger(delta=privacy.delta, dataset_size=n, accountant=privacy.accountant)
    training.engine = EDPEngine(
        training.model, training.optimizer, noise_multiplier=factor * sigma0, max_grad_norm=privacy.max_grad_norm,
        sample_rate=plan.sample_rate, dataset_size=n, micro_batches_per_device=privacy.edp_micro_batches_per_device,
        alphas=alphas, scaling=privacy.edp_scaling, schedule=schedule, steps_per_epoch=plan.steps_per_epoch,
        seed=privacy_seed(privacy, recipe.train.seed), secure_rng=privacy.secure_rng,
        ledger=training.ledger.record_step, distributed=dist, record_ids=record_ids(training.examples),
        verify=privacy.verify)
    if privacy.verify and probe_now:
        verify_with_task(training.engine, training.task, training.model)
    training.ledger.mechanism = training.engine.mechanism()  # after the probe: it says whether clipping was proven
    training.sampler = training.engine.sampler(plan.steps)
