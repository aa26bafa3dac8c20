"""`dptext mia`: membership-inference attacks and canary exposure against fine-tuned runs."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from typing_extensions import Annotated

from dptext.cli.common import JsonOption, make_output

# one paragraph per example: typer's rich help joins the lines of a paragraph
EXAMPLES = "\n\n".join([
    "Examples:",
    "dptext mia runs/audit-nonprivate runs/audit-eps8   (loss attack, side by side)",
    "dptext mia runs/audit-eps8 --attack all --references 4   (trains 4 reference models once)",
    "dptext mia canary runs/audit-eps8   (canary exposure; `dptext mia canary --help` for its options)",
    "dptext mia runs/audit-eps8 --attack one-run   (Steinke et al.: an ε lower bound from one run)",
])
CANARY_EXAMPLES = "\n\n".join([
    "Examples:",
    "dptext mia canary runs/audit-nonprivate runs/audit-eps8   (exposure per repetition count, side by side)",
    "dptext mia canary --compare-units recipe.yaml data.user_column=author --out runs/units   (trains the recipe "
    "at privacy.unit=example and =user, each canary one user, and compares exposure)",
])


CandidatesOption = Annotated[int, typer.Option(
    "--candidates", help="canary: secrets sampled from R to rank each canary against.")]
BatchSizeOption = Annotated[int, typer.Option("--batch-size", help="Scoring batch size.")]
CompareUnitsOption = Annotated[Optional[Path], typer.Option(
    "--compare-units", help="canary: train this recipe (KEY=VALUE overrides follow `canary`) twice, at "
    "privacy.unit=example and privacy.unit=user, with each canary's copies one synthetic user "
    "(audit.canary_unit=user), into --out/example and --out/user, and compare exposure.")]
UnitsOutOption = Annotated[Optional[Path], typer.Option(
    "--out", help="canary --compare-units: folder of the two runs (default: runs/<recipe>-units).")]


def mia(
    run_dirs: Annotated[List[str], typer.Argument(
        help="Run directories to audit (fine-tuned with an audit section), or `canary RUN_DIR...`.",
        show_default=False)],
    attack: Annotated[List[str], typer.Option(
        "--attack", help="loss, shadow, lira or all (repeatable); or one-run alone (a run trained with "
        "audit.one_run_canaries).")] = ["loss"],  # noqa: B006 - typer default
    references: Annotated[int, typer.Option(
        "--references", help="Shadow / reference models for shadow and lira (trained once, reused).")] = 2,
    max_examples: Annotated[Optional[int], typer.Option(
        "--max-examples", help="Audit at most this many non-members (and as many members).")] = None,
    candidates: CandidatesOption = 2000,
    batch_size: BatchSizeOption = 32,
    plot: Annotated[Optional[Path], typer.Option(
        "--plot", help="PNG of the ROC curves (default: FIRST_RUN/mia_not_private/roc.png).")] = None,
    compare_units: CompareUnitsOption = None,
    out: UnitsOutOption = None,
    k_plus: Annotated[Optional[int], typer.Option(
        "--k-plus", help="one-run: canaries guessed 'in' (lowest loss); default m/4.")] = None,
    k_minus: Annotated[Optional[int], typer.Option(
        "--k-minus", help="one-run: canaries guessed 'out' (highest loss); default m/4.")] = None,
    json_mode: JsonOption = False,
) -> None:
    """Audit what an attacker learns: membership-inference AUC and TPR at low FPR, or canary exposure."""
    output = make_output(json_mode)
    if run_dirs and run_dirs[0] == "canary" and not Path("canary").is_dir():
        if compare_units is not None:
            return _compare_units(output, compare_units, run_dirs[1:], out, candidates, batch_size)
        return _canary(output, _canary_reports(output, run_dirs[1:], candidates, batch_size))
    if compare_units is not None:
        from dptext.errors import UserError

        raise UserError("--compare-units measures canaries; run it as `dptext mia canary --compare-units RECIPE`.")
    if "one-run" in attack:
        return _one_run(output, run_dirs, attack, k_plus, k_minus, batch_size)
    from dptext.attacks.audit import ATTACKS, run_mia
    from dptext.attacks.audit_records import mia_folder
    from dptext.attacks.plot import plot_roc, run_label
    from dptext.finetune import run_finetune

    chosen = ATTACKS if "all" in attack else tuple(dict.fromkeys(attack))
    # reference models are trained by the training entry point, handed down: attacks never import finetune
    reports = run_mia(run_dirs, chosen, references=references, max_examples=max_examples, batch_size=batch_size,
                      output=output, train=run_finetune)
    target = plot or mia_folder(reports[0]["run_dir"]) / "roc.png"
    plot_roc(reports, target)
    rows = []
    for report in reports:
        for name, summary in report["attacks"].items():
            bound = summary.get("epsilon_lower_bound", {})
            rows.append([run_label(report), name, summary["auc"], summary["tpr_at_fpr_0.01"],
                         summary["tpr_at_fpr_0.001"], bound.get("epsilon"), report["privacy"]["epsilon"],
                         f"{report['members']}/{report['nonmembers']}"])
    output.table("Membership inference (members vs held-out non-members)",
              ["run", "attack", "AUC", "TPR@1%FPR", "TPR@0.1%FPR", "ε lower bound (95%)", "ε proven",
               "members/non-members"], rows)
    output.info(f"ROC curves: {target}")
    if any(not r["privacy"]["private"] for r in reports):
        output.info("Non-private runs have no proven ε; their lower bound uses δ = 1/(2n).")
    output.result({"runs": reports, "plot": str(target)})


def _one_run(output, run_dirs: list[str], attack: list[str], k_plus, k_minus, batch_size: int) -> None:
    from dptext.attacks.one_run_audit import one_run_audits
    from dptext.errors import UserError

    if set(attack) != {"one-run"}:
        raise UserError("--attack one-run audits other canaries than the loss/shadow/lira attacks; run it alone.")
    reports = one_run_audits(run_dirs, k_plus=k_plus, k_minus=k_minus, batch_size=batch_size, output=output)
    rows = [[r["recipe"], r["canaries"], r["guesses"], r["correct"], r["epsilon_lower_bound"], r["privacy"]["epsilon"],
             r["delta"]] for r in reports]
    output.table("One-run audit (Steinke, Nasr & Jagielski 2023)", ["run", "canaries m", "guesses r", "correct v",
                 "ε lower bound (95%)", "ε proven", "δ"], rows)
    output.result({"runs": reports})


def _canary_reports(output, run_dirs: list[str], candidates: int, batch_size: int) -> list[dict]:
    from dptext.attacks.canary_audit import canary_exposure
    from dptext.errors import UserError

    if not run_dirs:
        raise UserError("Give the run directory: dptext mia canary RUN_DIR.")
    return [canary_exposure(d, candidates=candidates, batch_size=batch_size, output=output) for d in run_dirs]


def _compare_units(output, recipe: Path, overrides: list[str], out: Optional[Path], candidates: int,
                   batch_size: int) -> None:
    from dptext.attacks.canary_units import UNITS, compare_canary_units, unit_overrides
    from dptext.config import load_recipe
    from dptext.errors import UserError
    from dptext.finetune import run_finetune

    stray = [value for value in overrides if "=" not in value]
    if stray:
        raise UserError(f"--compare-units takes KEY=VALUE overrides after `canary`, not {stray[0]!r}.")
    recipes = {unit: load_recipe(recipe, [*overrides, *unit_overrides(unit)]) for unit in UNITS}
    folder = out or Path("runs") / f"{recipes['user'].name}-units"
    # the training entry point is handed down: attacks sit below the training runs and never import them
    _canary(output, compare_canary_units(recipes, folder, run_finetune, output, candidates, batch_size))


def _canary(output, reports: list[dict]) -> None:
    from dptext.attacks.plot import run_label

    rows = [[run_label(r), r["privacy"]["unit"], "one user" if r["canary_unit"] == "user" else "a user each",
             g["repetitions"], g["canaries"],
             g["exposure_sampled_mean"], g["exposure_fitted_mean"], g["exposure_fitted_max"], r["log2_space_size"]]
            for r in reports for g in r["by_repetitions"]]
    output.table("Canary exposure (log2|R| - log2 rank; higher = more memorised)",
                 ["run", "privacy unit", "canary copies of", "repetitions", "canaries", "exposure (sampled rank)",
                  "exposure (fit)", "max (fit)", "log2|R|"], rows)
    first = reports[0]
    output.info(f"{first['candidates']} candidates per run ({'all of R' if first['exhaustive'] else 'sampled'}); "
             f"sampled ranks resolve exposure up to about {first['resolution_bits']:.1f} bits, the skew-normal "
             "fit extrapolates beyond.")
    output.result({"runs": reports})


def mia_canary(
    run_dirs: Annotated[Optional[List[str]], typer.Argument(
        help="Run directories fine-tuned with audit.canaries (or, with --compare-units, KEY=VALUE overrides).",
        show_default=False)] = None,
    candidates: CandidatesOption = 2000,
    batch_size: BatchSizeOption = 32,
    compare_units: CompareUnitsOption = None,
    out: UnitsOutOption = None,
    json_mode: JsonOption = False,
) -> None:
    """Canary exposure: how far above random secrets each inserted canary ranks (higher = more memorised)."""
    output = make_output(json_mode)
    if compare_units is not None:
        return _compare_units(output, compare_units, run_dirs or [], out, candidates, batch_size)
    return _canary(output, _canary_reports(output, run_dirs or [], candidates, batch_size))


CANARY_COMMAND = "mia canary"  # `dptext mia canary ...` is routed here by dptext.cli.app.main (its own --help)


def register(app: typer.Typer) -> None:
    app.command("mia", epilog=EXAMPLES)(mia)
    app.command(CANARY_COMMAND, hidden=True, epilog=CANARY_EXAMPLES)(mia_canary)
