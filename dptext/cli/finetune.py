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
    """Fine-tune with DP-Adam/DP-SGD (or the non-private baseline) and report metrics and ε."""
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

    rows = [[f"{name} ({result['eval_split']})", value, result["metrics_before_training"].get(name)]
            for name, value in result["metrics"].items()]
    privacy = result["privacy"]
    if privacy["private"]:
        for method, eps in privacy["epsilon"].items():
            label = {"rdp": "ε (RDP bound)", "prv": "ε (PRV estimate [lower, upper])", "pld": "ε (PLD bound)",
                     "gdp": "ε (GDP, CLT approximation)"}[method]
            value = eps["epsilon"] if eps["epsilon"] is not None else "— (outside PRV's range: see the PLD bound)"
            if method == "prv" and eps.get("lower") is not None:
                value = f"{eps['epsilon']:.4g} [{eps['lower']:.4g}, {eps['upper']:.4g}]"
            rows.append([label, value, None])
        mechanism = privacy.get("mechanism", {})
        if "guarantee" in mechanism:
            rows.append([f"guarantee ({mechanism['method']}, {mechanism['processes']} process(es))",
                         mechanism["guarantee"], None])
        if "randomness" in mechanism:
            rows.append(["sampler and noise", mechanism["randomness"], None])
        if mechanism.get("method") == "edp_sgd":
            leaks = " (LEAKS: measured on private data)" if mechanism["scaling_leaks"] else ""
            rows += [["z₀ (noise std / C, scaled space)", mechanism["z0"], None],
                     ["noise decay", mechanism["noise_schedule"], None],
                     ["scaling α", mechanism["scaling"] + leaks, None]]
        rows += [["δ", privacy["delta"], None], ["σ (noise multiplier)", privacy["noise_multiplier"], None],
                 ["C (clipping norm)", privacy["max_grad_norm"], None]]
    else:
        rows.append(["privacy", "none (non-private baseline)", None])
    if privacy.get("privacy_unit"):
        rows.append(["privacy unit", privacy["privacy_unit"], None])
    counted = privacy.get("counted", "examples")
    rows += [["steps", privacy["steps"], None], [f"expected batch ({counted})", privacy["expected_batch_size"], None],
             ["time (s)", result["seconds"], None]]
    output.table(f"{result['recipe']}: {result['model']} / {result['task']}", ["", "after training",
                                                                              "before training"], rows)
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
    output.info(f"Run directory: {result['run_dir']} (model in {result['model_dir']}, curves in metrics.jsonl)")
    render_not_covered(output, Path(result["run_dir"]))


def register(app: typer.Typer) -> None:
    app.command("finetune")(finetune)
