"""`dptext account --eps` over recipes plans with the n and the noise the training run will use.

Two recipe features change what a run trains on or how it is noised: an ``audit`` section holds examples out
(and adds canaries), and eDP-SGD composes a decaying σ schedule. The listing must agree with the run's own
calibration (``dptext.finetune``) for both, or users would read a σ the run never uses.
"""

from __future__ import annotations

import pytest

from dptext.accounting import calibrate_noise_multiplier, plan_for_recipe
from dptext.accounting.plan import recipe_sigmas
from dptext.data.audit_split import trained_size
from dptext.config import load_recipe
from dptext.finetune.edp import accounting_sigma, noise_schedule

SPLIT_SIZE = 1000


def _write(tmp_path, name: str, body: str):
    (tmp_path / f"{name}.yaml").write_text(body, encoding="utf-8")
    return load_recipe(tmp_path / f"{name}.yaml")


def _row(tmp_path, name: str) -> dict:
    rows = recipe_sigmas(8.0, tmp_path, train_size=lambda data_cfg: SPLIT_SIZE)
    return next(r for r in rows if r["recipe"] == name)


def test_audit_section_plans_with_the_trained_set_size(tmp_path):
    recipe = _write(tmp_path, "audited", "model: {name: tiny-gpt2}\ntrain: {batch_size: 50, epochs: 3}\n"
                    "audit: {holdout_examples: 200, public_examples: 300, canaries: 2, canary_repetitions: [1, 5]}\n")
    n = trained_size(recipe.audit, SPLIT_SIZE)
    assert n == SPLIT_SIZE - 200 - 300 + 2 * (1 + 5)
    row = _row(tmp_path, "audited")
    plan = plan_for_recipe(recipe, n)
    assert row["dataset_size"] == n
    assert row["sample_rate"] == pytest.approx(plan.sample_rate)
    assert row["delta"] == pytest.approx(1 / (2 * n))
    expected = calibrate_noise_multiplier(8.0, plan.delta, plan.sample_rate, plan.steps,
                                          steps_per_epoch=plan.steps_per_epoch).noise_multiplier
    assert row["noise_multiplier"] == pytest.approx(expected, rel=1e-9)


def test_edp_recipe_plans_with_its_decaying_schedule(tmp_path):
    recipe = _write(tmp_path, "edp", "model: {name: tiny-bert}\ntrain: {batch_size: 50, epochs: 4}\n"
                    "privacy: {method: edp_sgd, noise_decay: linear, noise_decay_rate: 0.5}\n")
    row = _row(tmp_path, "edp")
    plan = plan_for_recipe(recipe, SPLIT_SIZE)
    sigma0 = accounting_sigma(recipe, plan, 2, noise_schedule(recipe.privacy))  # what the eDP run calibrates
    constant = calibrate_noise_multiplier(8.0, plan.delta, plan.sample_rate, plan.steps,
                                          steps_per_epoch=plan.steps_per_epoch).noise_multiplier
    assert row["noise_multiplier"] == pytest.approx(sigma0, rel=1e-9)
    assert row["noise_multiplier"] > constant  # decaying noise must start higher to spend the same ε
    assert f"{2 * sigma0:.4g}" in row["note"]
