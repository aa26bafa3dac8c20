"""Issue 47's utility table: DP-SGD vs banded MF vs BLT on the same recipe, ε, δ, steps and expected batch.

    python benchmarks/collect_correlated.py /work/results-runs   # benchmarks/results/correlated_utility.json + table

The runs are the jobs of benchmarks/jobs_correlated.txt (``mf-RECIPE-MECHANISM``), all from one commit. Each row is
written only from a finished run (result.json); a row whose run folder is gone keeps its committed value, and a row
not yet finished prints as "not run yet", never as a number. ε is the one each run's own accountant proved for it:
DP-SGD's Poisson-sampled Gaussian (amplification by sampling), the correlated mechanisms' single Gaussian mechanism
scaled by the strategy's sensitivity over cyclic participations (no amplification claimed), so the rows share the
target ε, δ, steps and expected batch, and each says how its ε was reached.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from collect_results import arithmetic, machine_and_commit, read_json, timing, wall_seconds  # noqa: E402
from dptext.runs import DIAGNOSTICS, RunDir  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "correlated_utility.json"
MECHANISMS = ("dp_sgd", "banded_mf", "blt")
# recipe (the job names' middle part) -> the metrics its table shows (result.json names), higher is better
RECIPES = {"quickstart": ("accuracy",), "sst2": ("accuracy",), "e2e-cpu": ("bleu", "rouge_l")}
LABELS = {"dp_sgd": "DP-SGD (Poisson)", "banded_mf": "banded MF (cyclic)", "blt": "BLT (cyclic)"}
# Rows no job here has finished, taken from the same recipe's run at an earlier commit: E2E-CPU's DP-SGD job is
# recipes/e2e-cpu-dp.yaml as it is (only data.path and the name set), whose run of 25 Nov 2026 is in e2e_cpu.json;
# a fresh one takes longer than a session on this 2-core CPU (three tries were lost with their machines).
EARLIER = {("e2e-cpu", "dp_sgd"): ("e2e_cpu.json", "eps8", "recipes/e2e-cpu-dp.yaml")}
KEPT = ("delta", "noise_multiplier", "max_grad_norm", "steps", "expected_batch_size", "dataset_size", "run", "recipe",
        "eval_split", "train_seconds", "seconds_per_epoch", "invocations", "wall_seconds", "machine", "commit",
        "precision")


def run_name(recipe: str, mechanism: str) -> str:
    return f"mf-{recipe}-{mechanism}"


def row(run_dir: Path, metrics: tuple[str, ...]) -> dict:
    """One finished run: its metrics, the ε its accountant proved, the plan it trained under, time and code."""
    result, provenance = read_json(run_dir / "result.json"), read_json(run_dir / "provenance.json")
    privacy = result["privacy"]
    run = RunDir(run_dir)
    records = run.read_metrics(DIAGNOSTICS) + run.read_metrics()
    clock = timing(records, 1.0 / privacy["sample_rate"])
    accountant = privacy.get("accountant") or "rdp"
    proved = (privacy.get("epsilon") or {}).get(accountant) or next(iter((privacy.get("epsilon") or {}).values()))
    resolved = (run_dir / "resolved.yaml").read_text()
    settings = yaml.safe_load(resolved).get("privacy") or {}
    return {**{name: result["metrics"][name] for name in metrics},
            "mechanism": settings.get("mechanism", "dp_sgd"), "sampling": privacy.get("sampling"),
            "strategy": {key: value for key, value in (privacy.get("mechanism") or {}).items()
                         if key in ("strategy_sensitivity", "bands", "buffers", "separation", "max_participations")},
            "epsilon": proved["epsilon"], "epsilon_method": proved.get("note") or accountant,
            "target_epsilon": privacy.get("target_epsilon"), "delta": privacy["delta"],
            "noise_multiplier": privacy["noise_multiplier"], "max_grad_norm": privacy["max_grad_norm"],
            "steps": result.get("steps_run", privacy["steps"]), "expected_batch_size": privacy["expected_batch_size"],
            "dataset_size": privacy["dataset_size"], "run": run_dir.name, "recipe": result["recipe"],
            "eval_split": result["eval_split"], **clock, "wall_seconds": wall_seconds(run, records, clock),
            **machine_and_commit(provenance), "precision": arithmetic(resolved, provenance)}


def earlier_row(recipe: str, mechanism: str, metrics: tuple[str, ...]) -> dict | None:
    """The row of ``EARLIER``'s committed result for (recipe, mechanism), in ``row``'s fields, or None."""
    if (recipe, mechanism) not in EARLIER:
        return None
    file, key, recipe_path = EARLIER[(recipe, mechanism)]
    entry = read_json(RESULTS.parent / file)[key]
    settings = yaml.safe_load((ROOT / recipe_path).read_text())["privacy"]
    proved = entry["epsilon"][settings.get("accountant", "rdp")]
    return {**{name: entry[name] for name in metrics}, "mechanism": entry["method"], "sampling": "poisson",
            "strategy": {}, "epsilon": proved["epsilon"], "epsilon_method": proved["note"],
            "target_epsilon": float(settings["target_epsilon"]), **{name: entry[name] for name in KEPT},
            "source": f"benchmarks/results/{file} ({key}): the same recipe's run at an earlier commit"}


def collect(runs: Path, results: Path = RESULTS) -> dict[str, dict[str, dict]]:
    """Rewrite ``results`` from the finished runs in ``runs``, keeping committed rows whose runs are gone."""
    committed = read_json(results) if results.is_file() else {}
    data: dict[str, dict[str, dict]] = {}
    for recipe, metrics in RECIPES.items():
        for mechanism in MECHANISMS:
            folder = runs / run_name(recipe, mechanism)
            found = row(folder, metrics) if (folder / "result.json").is_file() else \
                committed.get(recipe, {}).get(mechanism) or earlier_row(recipe, mechanism, metrics)
            if found is not None:
                data.setdefault(recipe, {})[mechanism] = found
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(data, indent=2) + "\n")
    return data


def table(data: dict[str, dict[str, dict]]) -> str:
    """The markdown table: one line per recipe and mechanism, "not run yet" where no run has finished."""
    lines = ["| recipe | mechanism | metric | ε (δ) | σ | steps × batch | train hours |",
             "|---|---|---|---|---|---|---|"]
    for recipe, metrics in RECIPES.items():
        for mechanism in MECHANISMS:
            entry = data.get(recipe, {}).get(mechanism)
            if entry is None:
                lines.append(f"| {recipe} | {LABELS[mechanism]} | not run yet | | | | |")
                continue
            shown = ", ".join(f"{name} {entry[name]:.2f}" for name in metrics)
            shown += " (earlier commit)" if "source" in entry else ""
            lines.append(f"| {recipe} | {LABELS[mechanism]} | {shown} | {entry['epsilon']:.2f} "
                         f"({entry['delta']:.2g}) | {entry['noise_multiplier']:.3g} | {entry['steps']} × "
                         f"{entry['expected_batch_size']:.0f} | {entry['train_seconds'] / 3600:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="?", default=Path("/work/results-runs"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    print(table(collect(args.runs, args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
