"""From a recipe to its privacy plan (q, steps, δ) and the σ it would train with.

``plan_for_recipe`` is the single place that turns ``train.batch_size``, ``train.epochs``
(or ``train.max_steps``), ``privacy.delta`` and the training-set size into what the
accountant needs, so that ``dptext account --eps 3`` and a training run that calibrates
the same recipe agree on σ to the last digit: the accountant that calibrates a run is the
one that reports it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from dptext import data
from dptext.accounting.calibrate import calibrate_noise_multiplier, calibrate_one_mechanism
from dptext.accounting.events import (
    check_large_delta,
    check_sample_rate,
    check_steps,
    resolve_delta,
    sample_rate_for,
    steps_for_epochs,
    steps_per_epoch_for,
)
from dptext.accounting.schedule import CONSTANT, NoiseSchedule
from dptext.config import load_recipe
from dptext.data.audit_split import audit_requested, trained_size
from dptext.errors import UserError


@dataclass(frozen=True)
class PrivacyPlan:
    dataset_size: int | None
    sample_rate: float
    steps: int
    steps_per_epoch: int
    delta: float
    delta_source: str


def plan_for_recipe(recipe: Any, dataset_size: int, counted: str = "") -> PrivacyPlan:
    """q = B/n, steps = ceil(epochs/q) unless train.max_steps is set, δ = privacy.delta or 1/(2n).

    n counts the privacy units (``counted`` names them when they are not examples: "users" for user-level DP,
    where train.batch_size is the expected number of users per step and an epoch is one pass over the users)."""
    q = sample_rate_for(recipe.train.batch_size, dataset_size)
    steps = recipe.train.max_steps or steps_for_epochs(recipe.train.epochs, q)
    delta, source = resolve_delta(recipe.privacy.delta, dataset_size, counted)
    if recipe.privacy.enabled:
        check_large_delta(delta, source, recipe.privacy.allow_large_delta, "set privacy.allow_large_delta=true")
    return PrivacyPlan(dataset_size, q, steps, steps_per_epoch_for(q), delta, source)


def plan_from_options(sample_rate: float | None = None, steps: int | None = None, dataset_size: int | None = None,
                      batch_size: int | None = None, epochs: float | None = None, delta: float | None = None
                      ) -> PrivacyPlan:
    """The plan of a command-line query: q from --sample-rate or --batch-size/--dataset-size, steps
    from --steps or --epochs, δ from --delta or 1/(2n)."""
    if sample_rate is not None and batch_size is not None:
        raise UserError("Give either --sample-rate or --batch-size with --dataset-size, not both.")
    if steps is not None and epochs is not None:
        raise UserError("Give either --steps or --epochs, not both.")
    if sample_rate is None:
        if batch_size is None or dataset_size is None:
            raise UserError("Give --sample-rate, or both --batch-size and --dataset-size (q = batch size / n).")
        sample_rate = sample_rate_for(batch_size, dataset_size)
    q = check_sample_rate(sample_rate)
    if steps is None:
        if epochs is None:
            raise UserError("Give --steps, or --epochs (steps = epochs / q).")
        steps = steps_for_epochs(epochs, q)
    delta, source = resolve_delta(delta, dataset_size)
    return PrivacyPlan(dataset_size, q, check_steps(steps), steps_per_epoch_for(q), delta, source)


def shipped_recipes_dir() -> Path:
    """``recipes/`` of the source checkout, next to the package."""
    return Path(__file__).resolve().parents[2] / "recipes"


def recipe_sigmas(target_epsilon: float, directory: Path | None = None, delta: float | None = None,
                  train_size: Callable[[Any], int] | None = None) -> list[dict[str, Any]]:
    """For each recipe in ``directory``, the σ its own accountant calibrates at ``target_epsilon``.

    ``delta`` overrides every recipe's δ. A recipe whose training-set size cannot be
    determined (e.g. no local data and no published size) gets a row with the reason
    instead of stopping the whole listing.
    """
    directory = Path(directory) if directory else shipped_recipes_dir()
    paths = sorted(directory.glob("*.yaml")) + sorted(directory.glob("*.yml"))
    if not paths:
        raise UserError(f"No recipes (*.yaml) found in '{directory}'; pass --recipes DIR with your recipe files.")
    train_size = train_size or data.train_size  # looked up now, so a caller (or test) may stand in for it
    return [_recipe_row(path.stem, load_recipe(path), target_epsilon, delta, train_size) for path in paths]


def _recipe_row(name: str, recipe: Any, target_epsilon: float, delta: float | None,
                train_size: Callable[[Any], int]) -> dict[str, Any]:
    row: dict[str, Any] = {"recipe": name, "accountant": recipe.privacy.accountant}
    if not recipe.privacy.enabled:
        return {**row, "noise_multiplier": None, "note": "non-private recipe (privacy.enabled: false)"}
    if recipe.privacy.unit == "user":  # n would be the number of users, which this listing does not count
        return {**row, "noise_multiplier": None, "note": "privacy.unit=user: q counts users; the run calibrates σ "
                "from the number of users in its data (its ledger and summary report it)"}
    try:
        found = recipe_plan(recipe, train_size, target_epsilon, delta, pinned=False)
    except UserError as exc:
        return {**row, "noise_multiplier": None, "note": str(exc)}
    if recipe.privacy.noise_multiplier is not None:
        found["notes"].append(f"the recipe pins σ={recipe.privacy.noise_multiplier:g}, which overrides this")
    keys = ("dataset_size", "sample_rate", "steps", "delta", "delta_source", "noise_multiplier", "epsilon")
    return {**row, **{key: found[key] for key in keys}, "note": "; ".join(found["notes"])}


def recipe_plan(recipe: Any, train_size: Callable[[Any], int] | None = None, target_epsilon: float | None = None,
                delta: float | None = None, pinned: bool = True) -> dict[str, Any]:
    """What a private run of ``recipe`` would do, before it starts: n, q, steps, δ, and σ by the recipe's own
    accountant (calibrated to ``target_epsilon`` or the recipe's, or the recipe's pinned σ when ``pinned``).
    Raises the run's own refusals (e.g. an expected batch larger than n). Example-level recipes only: under
    privacy.unit=user n counts users, which only the run's data tells."""
    train_size = train_size or data.train_size
    plan = plan_for_recipe(recipe, _trained_size(recipe, train_size(recipe.data)))
    if delta is not None:
        plan = replace(plan, delta=resolve_delta(delta, None)[0], delta_source="given on the command line")
    privacy = recipe.privacy
    found: dict[str, Any] = {**plan.__dict__, "expected_batch_size": plan.sample_rate * plan.dataset_size,
                             "accountant": privacy.accountant, "epsilon": None, "notes": []}
    if pinned and privacy.noise_multiplier is not None:
        return {**found, "noise_multiplier": privacy.noise_multiplier,
                "sigma_source": "pinned (privacy.noise_multiplier)"}
    edp = privacy.method == "edp_sgd"
    target = target_epsilon if target_epsilon is not None else privacy.target_epsilon
    if privacy.mechanism in ("banded_mf", "blt"):  # one Gaussian mechanism, no amplification (finetune/banded_mf.py)
        calibration = calibrate_one_mechanism(target, plan.delta, privacy.accountant)
        found["notes"].append(f"{privacy.mechanism}: σ of one Gaussian mechanism (q = 1, one step, no amplification "
                              "by sampling), drawn before the strategy's filter")
    else:
        calibration = calibrate_noise_multiplier(target, plan.delta, plan.sample_rate, plan.steps,
                                                 method=privacy.accountant,
                                                 schedule=noise_schedule_for(privacy) if edp else CONSTANT,
                                                 steps_per_epoch=plan.steps_per_epoch)
    if calibration.approximate:
        found["notes"].append("GDP approximation")
    if edp:  # the training run adds noise z_0 = 2σ_0 (sensitivity 2C) unless every micro-batch holds one example
        found["notes"].append(f"eDP-SGD: σ is the accounted σ_0 of the first epoch ({privacy.noise_decay} decay); "
                              f"noise z_0 = 2σ_0 = {2 * calibration.noise_multiplier:.4g}")
    return {**found, "noise_multiplier": calibration.noise_multiplier, "epsilon": calibration.epsilon,
            "sigma_source": f"calibrated to ε = {target:g} by {privacy.accountant.upper()}"}


SMALL_N_DELTA = 1 / 2000  # the default δ = 1/(2n) exceeds this below n = 1,000
def delta_warning(delta: float, delta_source: str, dataset_size: int | None) -> str | None:
    """A warning when δ is large: (ε, δ)-DP allows a mechanism that publishes a whole record with probability δ, so
    at δ ≥ 1/n it may publish one of the n records outright (and at n = 1, δ = 0.5, the guarantee says little)."""
    if dataset_size and delta >= 1 / dataset_size:
        return (f"δ = {delta:.3g} is at least 1/n = 1/{dataset_size} ({delta_source}): (ε, δ)-DP at this δ allows "
                "publishing one of the n records outright, whatever ε says; use a δ well below 1/n (e.g. 1e-5).")
    if delta_source.startswith("1/(2n)") and delta > SMALL_N_DELTA:
        return (f"δ = 1/(2n) = {delta:.2g} is large at n = {dataset_size} (a run may publish a record with "
                f"probability up to δ); set privacy.delta (e.g. 1e-5) or train on more records.")
    return None


def _trained_size(recipe: Any, split_size: int) -> int:
    """n the run trains on: the training split less what an ``audit`` section holds out, plus its canaries."""
    return trained_size(recipe.audit, split_size) if audit_requested(recipe.audit) else split_size


def noise_schedule_for(privacy: Any) -> NoiseSchedule:
    """The σ schedule of a recipe's ``privacy`` section (eDP-SGD's noise decay by epoch; constant otherwise)."""
    if privacy.noise_decay == "none":
        return CONSTANT
    return NoiseSchedule("linear" if privacy.noise_decay == "linear" else "exp", rate=privacy.noise_decay_rate)
