"""`dptext finetune`: DP fine-tuning of a model on a dataset, as a recipe says."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from typing_extensions import Annotated

from dptext.cli.common import (JsonOption, OutOption, OverridesArgument, ResumeOption, make_output, recipe_to_run,
                               render_not_covered)


def finetune(
    recipe: Annotated[Optional[Path], typer.Argument(help="Recipe YAML file (see recipes/).",
                                                     show_default=False)] = None,
    overrides: OverridesArgument = None,
    out: OutOption = None,
    resume: ResumeOption = None,
    json_mode: JsonOption = False,
) -> None:
    """Fine-tune with DP-Adam/DP-SGD (or the non-private baseline) and report metrics and ε.

    Example:  dptext finetune recipes/quickstart.yaml privacy.target_epsilon=3 --out runs/qs-eps3
    """
    from dptext.finetune import run_finetune

    output = make_output(json_mode)
    result = run_finetune(recipe_to_run(recipe, overrides, resume), out=out, resume=resume, output=output)
    if result.get("follower"):  # torchrun rank > 0: rank 0 reports the run
        return
    render_result(output, result)
    output.result(result)


def render_result(output, result: dict) -> None:
    from dptext.accounting.carried import guaranteed_epsilon
    from dptext.accounting.ledger import epsilon_unit
    from dptext.accounting.plan import delta_warning

    metric_table(output, result)
    privacy = result["privacy"]
    rows: list[list] = []
    if privacy["private"]:
        for method, eps in privacy["epsilon"].items():
            label = {"rdp": "ε (RDP bound)", "prv": "ε (PRV estimate [lower, upper])", "pld": "ε (PLD bound)",
                     "gdp": "ε (GDP, CLT approximation)"}[method]
            value = eps["epsilon"] if eps["epsilon"] is not None else "— (outside PRV's range: see the PLD bound)"
            if method == "prv" and eps.get("lower") is not None:
                value = f"{eps['epsilon']:.4g} [{eps['lower']:.4g}, {eps['upper']:.4g}]"
            rows.append([label, value])
        mechanism = privacy.get("mechanism", {})
        if "guarantee" in mechanism:
            rows.append([f"guarantee ({mechanism['method']}, {mechanism['processes']} process(es))",
                         mechanism["guarantee"]])
        if "randomness" in mechanism:
            rows.append(["sampler and noise", mechanism["randomness"]])
        if mechanism.get("method") == "edp_sgd":
            leaks = " (LEAKS: measured on private data)" if mechanism["scaling_leaks"] else ""
            rows += [["z₀ (noise std / C, scaled space)", mechanism["z0"]],
                     ["noise decay", mechanism["noise_schedule"]],
                     ["scaling α", mechanism["scaling"] + leaks]]
        rows += [["δ", privacy["delta"]], ["σ (noise multiplier)", privacy["noise_multiplier"]],
                 ["C (clipping norm)", privacy["max_grad_norm"]]]
    else:
        rows.append(["privacy", "none (non-private baseline)"])
    if privacy.get("privacy_unit"):
        rows.append(["privacy unit", privacy["privacy_unit"]])
    counted = privacy.get("counted", "examples")
    rows += [["steps", privacy["steps"]], [f"expected batch ({counted})", privacy["expected_batch_size"]],
             ["time (s)", result["seconds"]]]
    output.table(f"{result['recipe']}: privacy and training", ["", "value"], rows)
    warning = privacy["private"] and delta_warning(privacy["delta"], privacy.get("delta_source", "given"),
                                                   privacy.get("dataset_size"))
    if warning:  # said at the start too, but a reader of the summary must not miss it
        output.warn(warning)
    headline = result["primary_metric"]
    if headline in result["metrics"]:
        before = result["metrics_before_training"].get(headline)
        change = f"{before:.4g} before training -> " if before is not None else ""
        guarantee = "without privacy"
        if privacy["private"]:
            method, bound = guaranteed_epsilon(privacy)
            guarantee = (f"at ε ≤ {bound:.3g} {epsilon_unit(privacy.get('mechanism'))} ({method.upper()} upper "
                         f"bound), δ = {privacy['delta']:.2g}")
            if not privacy.get("mechanism", {}).get("noise_secret", True):
                guarantee += " — only while train.seed stays secret (privacy.reproducible_noise=true)"
        output.info(f"Look at: {headline} {change}{result['metrics'][headline]:.4g} after training, {guarantee}.")
        baseline = result.get("baseline")
        if baseline and baseline["differs"]:
            output.info(f"Non-private baseline ({baseline['file']}) not shown: this run's recipe differs from its "
                        f"in {', '.join(baseline['differs'][:3])}.")
        elif baseline and headline in baseline["metrics"]:
            output.info(f"Non-private baseline of the same recipe: {headline} {baseline['metrics'][headline]:.4g} "
                        f"({baseline['file']}).")
    output.info(f"Run directory: {result['run_dir']} (model in {result['model_dir']}, curves in metrics.jsonl)")
    render_not_covered(output, Path(result["run_dir"]))


def metric_table(output, result: dict) -> None:
    """The metrics side by side: before training (eval.before_training), after, and the committed non-private
    baseline of the same recipe (eval.baseline); a column nobody asked for is left out, not filled with dashes."""
    found = result.get("baseline") or {}
    before, baseline = result["metrics_before_training"], {} if found.get("differs") else found.get("metrics", {})
    columns = [("before training", before)] if before else []
    columns.append(("after training", result["metrics"]))
    if baseline:
        columns.append(("non-private baseline (same recipe)", baseline))
    rows = [[f"{name} ({result['eval_split']})", *[values.get(name) for _, values in columns]]
            for name in result["metrics"]]
    output.table(f"{result['recipe']}: {result['model']} / {result['task']}", ["", *[c for c, _ in columns]], rows)


def register(app: typer.Typer) -> None:
    app.command("finetune")(finetune)
