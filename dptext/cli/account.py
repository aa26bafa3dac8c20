"""`dptext account`: ε for a noise multiplier, σ for a target ε, σ per recipe, or a run's ledger."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer
from typing_extensions import Annotated

from dptext.cli.common import JsonOption, make_output

LABELS = {"rdp": "RDP", "prv": "PRV", "pld": "PLD", "gdp": "GDP (approx.)"}
EXAMPLES = """
Examples:
  dptext account --sigma 1.0 --sample-rate 0.01 --steps 1000 --delta 1e-5
  dptext account --eps 3 --delta 1e-5 --sample-rate 0.02 --steps 1000
  dptext account --eps 3 --dataset-size 42061 --batch-size 1024 --epochs 10 --schedule exp:0.1
  dptext account --eps 3                      (σ for every shipped recipe)
  dptext account runs/e2e-20250101-120000     (ε spent by a run so far, and what ε covers in it)
  dptext account synthetic/amazon             (what ε covers in a `dptext synth` folder)
"""


def account(
    run_dir: Annotated[Optional[Path], typer.Argument(help="A run directory: the ε its ledger has spent and its "
                                                      "release manifest (or a `dptext synth` folder).",
                                                      show_default=False)] = None,
    eps: Annotated[Optional[float], typer.Option("--eps", "--epsilon", help="Target ε: find σ.")] = None,
    sigma: Annotated[Optional[float], typer.Option(
        "--sigma", "--noise-multiplier", help="Noise multiplier σ: find ε.")] = None,
    delta: Annotated[Optional[float], typer.Option(
        "--delta", help="δ (default 1/(2n) when --dataset-size is given); δ ≥ 0.1 is refused.")] = None,
    allow_large_delta: Annotated[bool, typer.Option(
        "--allow-large-delta", help="Accept δ ≥ 0.1 (given, or 1/(2n) at n ≤ 5): at such a δ any ε is "
        "meaningless; for demonstrations only.")] = False,
    sample_rate: Annotated[Optional[float], typer.Option(
        "--sample-rate", "-q", help="Poisson sampling rate q.")] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", help="Number of DP steps.")] = None,
    dataset_size: Annotated[Optional[int], typer.Option("--dataset-size", "-n", help="Training examples n.")] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="Expected batch size B (q = B/n).")] = None,
    epochs: Annotated[Optional[float], typer.Option("--epochs", help="Epochs (steps = ceil(epochs/q)).")] = None,
    schedule: Annotated[Optional[str], typer.Option(
        "--schedule", help="Noise decay by epoch: constant, linear:TAU, exp:TAU or list:F1,F2,...")] = None,
    method: Annotated[Optional[List[str]], typer.Option(
        "--method", help="Accountant(s) to use: rdp, prv, pld, gdp (repeatable; default all).")] = None,
    conversion: Annotated[str, typer.Option(
        "--conversion", help="RDP to (ε, δ): improved (Balle et al. 2020) or classical.")] = "improved",
    prv_eps_error: Annotated[Optional[float], typer.Option(
        "--prv-eps-error", help="Width of PRV's ε error bound (default 0.05; smaller is slower).")] = None,
    recipes: Annotated[Optional[Path], typer.Option(
        "--recipes", help="Recipe folder for `--eps` alone (default: the shipped recipes/).")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG of ε against steps per method.")] = None,
    json_mode: JsonOption = False,
) -> None:
    """Privacy accounting: ε from σ, σ from ε, σ per recipe, or a run's ε so far (RDP, PRV, PLD, GDP)."""
    from dptext.accounting.epsilon import check_methods
    from dptext.accounting.events import check_large_delta
    from dptext.errors import UserError

    out = make_output(json_mode)
    methods = check_methods(method)
    if delta is not None and delta < 1:  # (0, 1) itself is checked with the plan
        check_large_delta(delta, "--delta", allow_large_delta, "pass --allow-large-delta")
    if prv_eps_error is not None and not 0 < prv_eps_error < float("inf"):
        raise UserError(f"--prv-eps-error must be a positive width for PRV's ε bound (e.g. 0.05), got "
                        f"{prv_eps_error:g}.")
    plan_options = [sample_rate, steps, dataset_size, batch_size, epochs]
    if run_dir is not None:
        if eps is not None or sigma is not None or any(v is not None for v in plan_options) or schedule:
            raise UserError("A RUN_DIR is reported from its own ledger; drop --eps, --sigma and the step options.")
        if (run_dir / "release.json").is_file() and not (run_dir / "resolved.yaml").is_file():
            return _report_release(out, run_dir, {"query": "release", "folder": str(run_dir)})  # `dptext synth`
        return _report_ledger(out, run_dir, methods, conversion, plot, prv_eps_error)
    if eps is not None and sigma is not None:
        raise UserError("Give either --eps (to find σ) or --sigma (to find ε), not both.")
    if sigma is None and eps is None:
        raise UserError("Give --sigma to find ε, --eps to find σ, or a run directory; see `dptext account --help`.")
    if sigma is None and all(v is None for v in plan_options):
        if plot or schedule:
            raise UserError("--plot and --schedule need --sample-rate/--steps (or --dataset-size/--batch-size).")
        return _report_recipes(out, eps, recipes, delta)

    from dptext.accounting.events import check_epsilon, check_noise_multiplier
    from dptext.accounting.plan import plan_from_options
    from dptext.accounting.schedule import parse_schedule

    plan = plan_from_options(sample_rate, steps, dataset_size, batch_size, epochs, delta)
    check_large_delta(plan.delta, plan.delta_source, allow_large_delta, "pass --allow-large-delta")  # 1/(2n), n ≤ 5
    noise = parse_schedule(schedule)
    if sigma is not None:
        check_noise_multiplier(sigma)
    else:
        check_epsilon(eps)
    out.info(f"q={plan.sample_rate:.6g}, {plan.steps} steps, schedule {noise.describe()}, "
             f"δ={plan.delta:g} ({plan.delta_source})")
    if sigma is not None:
        return _report_epsilon(out, plan, noise, sigma, methods, conversion, prv_eps_error, plot)
    if plot:
        raise UserError("--plot draws ε for a given σ; use it with --sigma or a run directory.")
    return _report_sigma(out, plan, noise, eps, methods, conversion, prv_eps_error)


def _report_epsilon(out, plan, noise, sigma, methods, conversion, prv_eps_error, plot) -> None:
    from dptext.accounting.epsilon import compute_all

    runs = noise.step_runs(sigma, plan.sample_rate, plan.steps, plan.steps_per_epoch)
    results = compute_all(runs, plan.delta, methods, conversion, prv_eps_error)
    out.table(f"ε after {plan.steps} steps with σ={sigma:g}, δ={plan.delta:g}",
              ["method", "ε", "lower", "upper", "note"],
              [[LABELS[r.method], r.epsilon, r.lower, r.upper, r.note] for r in results])
    out.result({"query": "epsilon", **_plan_dict(plan), "noise_multiplier": sigma, "schedule": noise.describe(),
                "results": [r.to_dict() for r in results]})
    if plot:
        noise_text = f"σ={sigma:g}" if noise.kind == "constant" else f"σ₀={sigma:g} ({noise.describe()})"
        _plot(out, runs, plan.delta, methods, prv_eps_error, plot, f"{noise_text}, q={plan.sample_rate:.4g}")


def _report_sigma(out, plan, noise, eps, methods, conversion, prv_eps_error) -> None:
    from dptext.accounting.calibrate import calibrate_noise_multiplier

    rows, results = [], []
    for m in methods:
        cal = calibrate_noise_multiplier(eps, plan.delta, plan.sample_rate, plan.steps, m, noise,
                                         plan.steps_per_epoch, conversion=conversion, prv_eps_error=prv_eps_error)
        note = {"rdp": f"RDP bound ({conversion} conversion)", "prv": "meets ε on PRV's upper bound",
                "pld": "PLD upper bound", "gdp": "CLT approximation, not a guarantee; refused for training"}[m]
        rows.append([LABELS[m], cal.noise_multiplier, cal.epsilon, note])
        results.append({"method": m, "noise_multiplier": cal.noise_multiplier, "epsilon": cal.epsilon,
                        "approximate": cal.approximate, "note": note})
    first = " (σ of the first epoch)" if noise.kind != "constant" else ""
    out.table(f"σ for ε={eps:g}, δ={plan.delta:g}{first}", ["method", "σ", "ε at σ", "note"], rows)
    out.result({"query": "noise_multiplier", "target_epsilon": eps, **_plan_dict(plan),
                "schedule": noise.describe(), "results": results})


def _report_recipes(out, eps, directory, delta) -> None:
    from dptext.accounting.plan import recipe_sigmas

    rows = recipe_sigmas(eps, directory, delta)
    out.table(f"σ each recipe would use at ε={eps:g} (its own q, steps, δ and accountant)",
              ["recipe", "n", "q", "steps", "δ", "accountant", "σ", "note"],
              [[r["recipe"], r.get("dataset_size"), r.get("sample_rate"), r.get("steps"), r.get("delta"),
                r["accountant"], r["noise_multiplier"], r["note"]] for r in rows])
    out.result({"query": "recipes", "target_epsilon": eps, "results": rows})


def _report_ledger(out, run_dir, methods, conversion, plot, prv_eps_error) -> None:
    from dptext.accounting.ledger import CORRELATED_MECHANISMS, PrivacyLedger, epsilon_unit
    from dptext.errors import UserError
    from dptext.runs import RunDir

    data = RunDir.open(run_dir).load_ledger()
    if data is None:
        raise UserError(f"'{run_dir}' has no privacy ledger yet: it has taken no DP step (or trains non-privately).")
    ledger = PrivacyLedger.from_dict(data)
    results = [ledger.epsilon(m, conversion, prv_eps_error) for m in methods]
    out.info(f"{run_dir}: {ledger.steps} steps in {len(ledger.runs)} run(s) of identical (q, σ), "
             f"δ={ledger.delta:g} ({ledger.delta_source}), accountant {ledger.accountant}")
    mechanism = ledger.mechanism or {}
    # what each accountant covers: matrix-factorization runs the cyclic schema, DP-SGD Poisson sampling
    accounted = "cyclic" if mechanism.get("method") in CORRELATED_MECHANISMS else "poisson"
    if mechanism.get("sampling", accounted) != accounted:
        out.warn(f"This run sampled by {mechanism['sampling']}, which the Poisson accountant does not cover: "
                 "the ε below is NOT a guarantee for it.")
    if mechanism.get("noise_secret") is False:
        out.warn("This run's sampler and noise were derived from train.seed (privacy.reproducible_noise=true): "
                 "the ε below holds only while that seed stays secret.")
    unit = epsilon_unit(ledger.mechanism)
    out.table(f"ε spent after {ledger.steps} steps, {unit}", ["method", "ε", "lower", "upper", "note"],
              [[LABELS[r.method], r.epsilon, r.lower, r.upper, r.note] for r in results])
    headline = next((r for r in results if r.method == ledger.accountant and r.guaranteed is not None),
                    next((r for r in results if r.guaranteed is not None), None))
    if headline is not None:  # an upper bound: PRV's upper end, never its estimate
        out.info(f"ε ≤ {headline.guaranteed:.4g} {unit} ({LABELS[headline.method]}, δ={ledger.delta:g})")
    _report_carried(out, run_dir)
    if plot:
        _plot(out, ledger.accounted_runs(), ledger.delta, methods, prv_eps_error, plot, str(run_dir))
    _report_release(out, run_dir, {"query": "ledger", "run_dir": str(run_dir), **ledger.to_dict(with_epsilon=False),
                                   "results": [r.to_dict() for r in results]})


def _report_carried(out, run_dir: Path) -> None:
    """A run whose model carries more than its own steps (a DPKD student: its teacher's share) says so."""
    from dptext.accounting.carried import ONE_RUN, carried_privacy
    from dptext.runs import RunDir

    result = RunDir.open(run_dir).load_result()
    carried = carried_privacy(result) if result is not None else None
    if carried is not None and carried["private"] and carried["composition"] != ONE_RUN:
        out.warn(f"The table is this run's own DP-SGD steps; its model carries ε ≤ {carried['epsilon']:.4g}, "
                 f"δ = {carried['delta']:.3g} in all ({carried['composition']}).")


def _report_release(out, folder: Path, result: dict[str, Any]) -> None:
    """The folder's release.json: what ε covers, what is a public input, what is not covered and why."""
    from dptext.release import read_manifest

    manifest = read_manifest(folder)
    if manifest is None:
        out.warn(f"{folder} has no release.json (written by an older dptext): what ε covers is not listed.")
        return out.result(result)
    groups: dict[tuple, list] = {}  # a folder's files with one status are one row: checkpoints/, model/ ...
    missing = [item["path"] for item in manifest["files"] if not (folder / item["path"]).is_file()]
    for item in manifest["files"]:
        top = item["path"].split("/", 1)[0] + ("/" if "/" in item["path"] else "")
        if item["path"] in missing:  # listed when it was written, gone since: never "covered"
            item = {**item, "status": "MISSING", "why": "listed in release.json but not on disk"}
        groups.setdefault((top, item["status"]), []).append(item)
    rows = [[top if len(items) == 1 and not top.endswith("/") else f"{top} ({len(items)} files)", status,
             items[0].get("why") or items[0]["what"]] for (top, status), items in groups.items()]
    for flag, reason in manifest.get("flags", {}).items():
        out.warn(f"{flag}: {reason}")
    if manifest.get("privacy_unit"):
        out.info(f"Privacy unit: {manifest['privacy_unit']['text']}")
    out.table(f"What ε covers in {folder}", ["file", "status", "what / why"], rows)
    if missing:
        out.warn(f"{len(missing)} file(s) that release.json lists are missing from {folder} "
                 f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); they are not in this release.")
    if manifest.get("kind") == "synth" and not (folder / "provenance.json").is_file():
        out.warn(f"{folder} is an unfinished `dptext synth` folder (no provenance.json): its synthetic data is not "
                 "all written; run the same `dptext synth` command again to finish it.")
    out.result({**result, "release": manifest, "missing": missing})


def _plan_dict(plan) -> dict[str, Any]:
    return {"sample_rate": plan.sample_rate, "steps": plan.steps, "dataset_size": plan.dataset_size,
            "delta": plan.delta, "delta_source": plan.delta_source}


def _plot(out, runs, delta, methods, prv_eps_error, path: Path, subtitle: str) -> None:
    """ε against steps per method; PRV with its error band, GDP dashed as the approximation it is."""
    from dptext.accounting.curve import epsilon_curves
    from dptext.errors import UserError
    from dptext.runs import atomic_write

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib; install it with `pip install matplotlib`.") from None
    curves = epsilon_curves(runs, delta, methods, prv_eps_error=prv_eps_error)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, c in curves.items():
        if any(v is None for v in c["epsilon"]):
            out.warn(f"{LABELS[m]} is not plotted: it could not be computed for this run.")
            continue
        label = {"gdp": "GDP (CLT approximation)", "prv": "PRV estimate (band: bounds)",
                 "pld": "PLD bound"}.get(m, "RDP bound")
        ax.plot(c["steps"], c["epsilon"], linestyle="--" if m == "gdp" else "-", label=label)
        if m == "prv":
            ax.fill_between(c["steps"], c["lower"], c["upper"], alpha=0.25)
    ax.set_xlabel("steps")
    ax.set_ylabel(f"ε at δ={delta:g}")
    ax.set_title(f"Privacy spent — {subtitle}")
    ax.grid(alpha=0.3)
    ax.legend()
    atomic_write(path, lambda handle: fig.savefig(handle, format="png", dpi=120, bbox_inches="tight"), binary=True)
    plt.close(fig)
    out.info(f"plot written to {path}")


def register(app: typer.Typer) -> None:
    app.command("account", help=(account.__doc__ or "") + "\n" + EXAMPLES)(account)
