"""`dptext check`: validate a recipe and print it resolved, or print the recipe schema."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from typing_extensions import Annotated

from dptext.cli.common import JsonOption, OverridesArgument, make_output


def check(
    recipe: Annotated[Optional[Path], typer.Argument(help="Recipe YAML file to validate.", show_default=False)] = None,
    overrides: OverridesArgument = None,
    schema: Annotated[bool, typer.Option("--schema", help="Print every recipe key with its type, default and "
                                         "meaning.")] = False,
    model: Annotated[Optional[str], typer.Option("--model", help="Check this model (name or folder) with the privacy "
                                                 "engine's start-up probe instead of a recipe.")] = None,
    head: Annotated[str, typer.Option("--head", help="Model head for --model: causal_lm, masked_lm, "
                                      "sequence_classification or base.")] = "causal_lm",
    clipping_mode: Annotated[str, typer.Option("--clipping-mode",
                                               help="bookkeeping, ghost or per_sample.")] = "bookkeeping",
    clipping_layout: Annotated[str, typer.Option("--clipping-layout", help="all_layer or per_layer.")] = "all_layer",
    json_mode: JsonOption = False,
) -> None:
    """Validate a recipe (with overrides) as `dptext finetune` would, without loading weights, and print it resolved
    with its plan (n, q, steps, δ, σ, expected batch, micro-batch); or, with --model, probe a model's layers.

    Example:  dptext check recipes/quickstart.yaml privacy.target_epsilon=3
    """
    from dptext import config
    from dptext.errors import UserError

    out = make_output(json_mode)
    if model is not None:
        from dptext.privacy.proof.model_check import check_model

        result = check_model(model, head=head, clipping_mode=clipping_mode, clipping_layout=clipping_layout,
                             num_labels=2 if head == "sequence_classification" else None)
        rows = [[r["name"], r["kind"], r["rule"], r["status"], r["why"]] for r in result["layers"]]
        out.table(f"{model}: {result['verdict']} ({clipping_mode}, {clipping_layout}; probe "
                  f"{result['seconds']} s)", ["layer", "class", "rule", "status", "why"], rows)
        problem = result.get("why") or result.get("loss") or result.get("state")
        if problem:
            out.warn(problem)
        out.result(result)
        return
    if schema:
        rows = config.schema_docs()
        out.table("Recipe schema", ["key", "type", "default", "meaning"], rows)
        out.result([{"key": k, "type": t, "default": d, "doc": doc} for k, t, d, doc in rows])
        return
    if recipe is None:
        raise UserError("Give a recipe file to check, e.g. `dptext check recipes/quickstart.yaml`, or pass --schema.")
    resolved = config.load_recipe(recipe, overrides or [])
    from dptext.finetune.validate import validate_local_data, validate_run

    validate_run(resolved, check_out=False)  # what `dptext finetune` checks before loading weights
    validate_local_data(resolved)
    plan = run_plan(resolved)  # and the plan it would build (refusing, e.g., an expected batch larger than n)
    if json_mode:
        out.result({**config.to_dict(resolved), "plan": plan})
        return
    print(config.dump_recipe(resolved), end="")
    out.table(f"Plan of {recipe}", ["", "value"], plan_rows(plan))
    if plan.get("warning"):
        out.warn(plan["warning"])
    out.info(f"# {recipe}: valid")


def run_plan(recipe) -> dict:
    """n, q, steps, δ, σ, expected batch and micro-batch of the run `dptext finetune` would start."""
    from dptext.accounting.plan import delta_warning, plan_for_recipe, recipe_plan
    from dptext.data import train_size

    physical = recipe.train.physical_batch_size
    micro = physical if physical else "chosen at the start: 16 on CPU, the largest that fits on a GPU"
    if recipe.privacy.enabled and recipe.privacy.unit == "user":
        return {"private": True, "micro_batch": micro, "note": "privacy.unit=user: n, q and σ count users, which "
                "the run finds in its data and prints before the first step"}
    if not recipe.privacy.enabled:
        found = dict(plan_for_recipe(recipe, train_size(recipe.data)).__dict__)
        found["expected_batch_size"] = found["sample_rate"] * found["dataset_size"]
        return {"private": False, **found, "micro_batch": micro, "note": "non-private baseline: no clipping, no noise"}
    found = recipe_plan(recipe)
    if recipe.privacy.mechanism != "dp_sgd":
        found.update(correlated_noise_plan(recipe, found["delta"]))
    warning = delta_warning(found["delta"], found["delta_source"], found["dataset_size"])
    return {"private": True, **found, "max_grad_norm": recipe.privacy.max_grad_norm, "micro_batch": micro,
            "clipping": clipping_plan(recipe), **({"warning": warning} if warning else {})}


def clipping_plan(recipe) -> str:
    """How the clipped sums are formed, and for long sequences which layers the hybrid gives the ghost treatment
    (``dptext.privacy.clipping.long_sequences``: by bytes per example, T × (input + output width) × 4 in fp32)."""
    privacy, length = recipe.privacy, recipe.data.max_length
    if privacy.clipping_mode != "bookkeeping":
        return f"{privacy.clipping_mode} ({privacy.clipping_layout})"
    if privacy.max_stored_bytes is None:
        return (f"book-keeping ({privacy.clipping_layout}): one backward pass, every layer's records kept until the "
                "norms are known (privacy.max_stored_bytes unset)")
    width = privacy.max_stored_bytes / (4 * length)
    return (f"book-keeping with ghost treatment for Linear/Conv1D/Embedding layers (not tied) whose input + output "
            f"width exceeds {width:.0f}: their records would pass privacy.max_stored_bytes = "
            f"{privacy.max_stored_bytes} bytes per example at T = {length} (fp32); a second backward pass forms "
            "their clipped sums")


def correlated_noise_plan(recipe, delta: float) -> dict:
    """σ of a banded MF / BLT run: one Gaussian mechanism of sensitivity 1 (DP-SGD's Poisson σ is not the one it
    draws), scaled at start-up by the strategy's sensitivity, which the optimised coefficients decide."""
    from dptext.finetune.banded_mf import mf_noise_multiplier

    privacy = recipe.privacy
    return {"noise_multiplier": mf_noise_multiplier(privacy, delta),
            "sigma_source": f"{privacy.mechanism}: one Gaussian mechanism at ε = {privacy.target_epsilon}, times the "
                            "strategy's sensitivity found at start-up (mf_strategy.json)",
            "sampling": "cyclic: each example once per epoch, no amplification claimed"}


def plan_rows(plan: dict) -> list[list]:
    if "dataset_size" not in plan:
        return [["micro-batch", plan["micro_batch"]], ["note", plan["note"]]]
    sampling = ["q = B/n (cyclic batches)", f"{plan['sample_rate']:.4g} ({plan['sampling']})"] if "sampling" in plan \
        else ["q = B/n (Poisson sampling rate)", plan["sample_rate"]]
    rows = [["n (training examples)", plan["dataset_size"]], sampling,
            ["steps", plan["steps"]], ["expected batch (q·n)", plan["expected_batch_size"]],
            ["micro-batch", plan["micro_batch"]]]
    if not plan["private"]:
        return rows + [["privacy", plan["note"]]]
    rows += [["δ", f"{plan['delta']:.3g} ({plan['delta_source']})"],
             ["σ (noise multiplier)", f"{plan['noise_multiplier']:.4g} ({plan['sigma_source']})"],
             ["C (clipping norm)", plan["max_grad_norm"]], ["clipping", plan["clipping"]]]
    return rows + [["note", note] for note in plan["notes"]]


def register(app: typer.Typer) -> None:
    app.command("check")(check)
