"""`dptext models`: list the offline models and prepare them (convert SmolLM2 once)."""

from __future__ import annotations

from typing import List, Optional

import typer
from typing_extensions import Annotated

from dptext.cli.common import JsonOption, make_output


def models(
    prepare: Annotated[
        Optional[List[str]],
        typer.Option("--prepare", help="Make an offline alias ready now (e.g. convert smollm2-135m's GGUF once)."),
    ] = None,
    check: Annotated[
        Optional[str],
        typer.Option("--check", help="Load this model (alias, folder or hub name) and run one forward pass."),
    ] = None,
    json_mode: JsonOption = False,
) -> None:
    """List the offline model aliases and their status; prepare or check one."""
    from dptext import models as model_lib
    from dptext.errors import UserError

    out = make_output(json_mode)
    result: dict = {}
    for alias in prepare or []:
        if alias == "smollm2-135m":
            out.info("Converting SmolLM2-135M from GGUF to a cached fp32 folder (once, ~30 s)...")
            result.setdefault("prepared", {})[alias] = str(model_lib.smollm2_folder())
        elif alias in model_lib.OFFLINE_MODELS or alias in model_lib.TINY_MODELS:
            result.setdefault("prepared", {})[alias] = model_lib.model_source(alias)
        else:
            raise UserError(f"'{alias}' is not an offline alias; choose one of "
                            f"{', '.join(list(model_lib.OFFLINE_MODELS) + list(model_lib.TINY_MODELS))}.")
    if check:
        result["check"] = model_lib.smoke_test(check)
        out.info(f"{check}: {result['check']['class']} with {result['check']['parameters']:,} parameters, "
                 f"forward pass OK ({result['check']['seconds']:.1f} s).")
    rows = model_lib.describe_models()
    result["models"] = rows
    out.table("Offline models", ["name", "status", "description"],
              [[r["name"], r["status"], r["description"]] for r in rows])
    out.info("Any Hugging Face hub name (gpt2, roberta-base) or local model folder also works where a model is "
             "asked for.")
    out.result(result)


def register(app: typer.Typer) -> None:
    app.command("models")(models)
