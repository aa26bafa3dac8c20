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
    """Validate a recipe (with overrides) as `dptext finetune` would, without loading weights, and print it resolved;
    or, with --model, probe a model's layers."""
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
    if json_mode:
        out.result(config.to_dict(resolved))
    else:
        out.info(f"# {recipe}: valid")
        print(config.dump_recipe(resolved), end="")


def register(app: typer.Typer) -> None:
    app.command("check")(check)
