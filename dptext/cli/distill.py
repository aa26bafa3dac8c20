"""`dptext distill`: DistilDP student training and the paper's baselines, as a recipe's distill section says."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from typing_extensions import Annotated

from dptext.cli.common import (JsonOption, OutOption, OverridesArgument, ResumeOption, make_output, recipe_to_run,
                               render_not_covered)


def distill(
    recipe: Annotated[Optional[Path], typer.Argument(help="Recipe YAML with a distill: section (see recipes/).",
                                                     show_default=False)] = None,
    overrides: OverridesArgument = None,
    out: OutOption = None,
    resume: ResumeOption = None,
    json_mode: JsonOption = False,
) -> None:
    """Train a student from a DP teacher (distildp) or run a baseline (dp_sgd, dpkd, synthetic_only, zero_shot).

    Example:  dptext distill recipes/amazon-distill.yaml data.path=$DPTEXT_DATA/amazon_multidomain_sentiment
    distill.teacher=runs/teacher distill.synthetic=runs/synthetic
    """
    from dptext.distill import run_distill

    output = make_output(json_mode)
    result = run_distill(recipe_to_run(recipe, overrides, resume), out=out, resume=resume, output=output)
    render(output, result)
    output.result(result)


def render(output, result: dict) -> None:
    from dptext.accounting.carried import carried_privacy

    claim = carried_privacy(result)  # what the student's model carries: an upper bound, with a DPKD teacher's share
    student = result["student"]
    rows = [["method", result["method"]],
            [f"perplexity ({result['eval_split']}, real data)", result["metrics"].get("perplexity")],
            ["student", f"{student['source']} layers {student['layers']} ({student['parameters']:,} parameters)"],
            ["ε", claim["epsilon"]], ["δ", claim["delta"]], ["time (s)", result["seconds"]]]
    output.table(f"{result['recipe']}: student", ["", "value"], rows)
    how = claim["composition"] or ""
    output.info(f"Privacy: {how}. Run directory: {result['run_dir']}")
    render_not_covered(output, Path(result["run_dir"]))


def register(app: typer.Typer) -> None:
    app.command("distill")(distill)
