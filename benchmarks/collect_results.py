"""Write benchmarks/results/*.json from finished run directories, and the tables of docs/results.md from those files.

    python benchmarks/collect_results.py collect /work/results-runs   # JSON files + docs/results.md block
    python benchmarks/collect_results.py readme                      # docs/results.md block from the JSON files only

Which run feeds which entry is fixed below (the job names of benchmarks/jobs.txt). An
entry is written only from a finished run (result.json); an entry with several candidate runs (a
learning-rate search) is written once every candidate has finished, from the candidate with the best
VALIDATION value of its selection metric, with the whole search recorded beside it. A missing entry
shows as "running" in docs/results.md, never as a number.

Each entry holds the schema's metrics (percent) plus: ε by each accountant the run reported (RDP, PRV
with its bounds, GDP) and by the PLD accountant of dp-accounting (computed here from the run's ledger:
tight at any σ, where PRV refuses σ < 0.75), δ, σ, C, q, steps taken and planned, training seconds,
seconds per epoch, wall seconds, the machine, the arithmetic (fp32, or a GPU's bf16/fp16) and the git commit of
the code that ran.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dptext.runs import DIAGNOSTICS, RunDir  # noqa: E402  (after the path: runs from a checkout without installing)
sys.path.insert(0, str(ROOT / "benchmarks"))
# the queue's searches choose as collect does
from results_queue import LOWER_IS_BETTER, best_of, finished_scores  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "docs" / "results.md"  # the page holding the generated tables
NLU = {"ser": "ser", "intent_accuracy": "intent_acc", "slot_f1": "slot_f1"}
# ATIS's and SNIPS's DP searches: 5e-4 and 2e-3 first, then 5e-3, since 2e-3 was the top and best of each first grid
# (jobs.txt extends a grid upward while its best is at the top).
NLU_LRS = ("5e-4", "2e-3", "5e-3")
# SST-2's second, full-length tuning pass (3 epochs of the tuning split) over the best three rates of the one-epoch
# pass (1e-4 .. 2e-3, which favoured large rates that then drifted): the ε = 8 and ε = 3 rows use the rate it chooses.
SST2_LRS = ("5e-4", "1e-3", "2e-3")
DISTILL_CHAIN = "distill-long"  # the DistilDP runs' folder (benchmarks/jobs.txt): distill.json, via collect_distill.py


@dataclass(frozen=True)
class Tuned:
    """A learning rate chosen on tuning runs (their own held-out split), then the final run at that rate."""
    tuning: str  # run name with {lr}: its result.json metric on the tuning split decides
    final: str  # run name with {lr}: the run reported
    learning_rates: tuple[str, ...]


# file -> (schema metric -> result.json metric, entry -> candidate run names)
FILES = {
    "sst2": ({"accuracy": "accuracy"},
             {"nonprivate": ["sst2-nonprivate"], "eps8": Tuned("sst2-tune3-lr{lr}", "sst2-eps8-lr{lr}", SST2_LRS),
              "eps3": Tuned("sst2-tune3-lr{lr}", "sst2-eps3-lr{lr}", SST2_LRS)}),
    "atis": (NLU, {"nonprivate": ["atis-nonprivate"], "dp_sgd_eps8": [f"atis-dpsgd-eps8-lr{lr}" for lr in NLU_LRS],
                   "edp_eps8": [f"atis-edp-eps8-lr{lr}" for lr in NLU_LRS]}),
    "snips": (NLU, {"nonprivate": ["snips-nonprivate"],
                    "dp_sgd_eps8": [f"snips-dpsgd-eps8-lr{lr}" for lr in NLU_LRS],
                    "edp_eps8": [f"snips-edp-eps8-lr{lr}" for lr in NLU_LRS]}),
    "quickstart": ({"accuracy": "accuracy"}, {"nonprivate": ["quickstart-nonprivate"],
                                              "nonprivate_lr5e-4": ["quickstart-nonprivate-lr5e-4"],
                                              "nonprivate_lr1e-4": ["quickstart-nonprivate-lr1e-4"],
                                              "eps8": ["quickstart-eps8"]}),
    "e2e_cpu": ({"bleu": "bleu", "rouge_l": "rouge_l", "perplexity": "perplexity"},
                {"nonprivate": ["e2e-cpu-nonprivate"], "eps8": ["e2e-cpu-eps8"]}),
}


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def epsilon_pld(ledger: dict) -> float:
    """ε of the ledger's Poisson-subsampled Gaussian steps by dp-accounting's PLD accountant (add/remove)."""
    events = [dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(
        run["sample_rate"], dp_event.GaussianDpEvent(run["noise_multiplier"])), run["steps"]) for run in ledger["runs"]]
    accountant = pld_privacy_accountant.PLDAccountant()
    accountant.compose(dp_event.ComposedDpEvent(events))
    return float(accountant.get_epsilon(ledger["delta"]))


def timing(records: list[dict], steps_per_epoch: float) -> dict:
    """Training seconds summed over invocations (a resume restarts the clock) and seconds per epoch.

    ``records`` are the run's timed step records in the order written (``step`` and ``seconds``) and its evaluation
    records (``step`` and ``split``), in one list or in two concatenated. Seconds per epoch uses only the intervals
    between logged steps with no evaluation inside them (an evaluation at step s follows the log line of step s)."""
    evaluations = {record["step"] for record in records if "split" in record}
    segments, last, train_time, train_steps = [], None, 0.0, 0
    for record in records:
        if "seconds" not in record or "split" in record:
            continue
        if last is None or record["seconds"] < last["seconds"]:  # a new invocation (resume)
            segments.append(0.0)
        elif not any(last["step"] <= step < record["step"] for step in evaluations):
            train_time += record["seconds"] - last["seconds"]
            train_steps += record["step"] - last["step"]
        segments[-1] = record["seconds"]
        last = record
    per_epoch = train_time / train_steps * steps_per_epoch if train_steps else None
    return {"train_seconds": sum(segments), "seconds_per_epoch": per_epoch, "invocations": len(segments)}


def entry(run_dir: Path, metric_names: dict) -> dict:
    result, provenance = read_json(run_dir / "result.json"), read_json(run_dir / "provenance.json")
    # The per-step clock is in the not-covered diagnostics file since the release registry (issue 14), in
    # metrics.jsonl before it; the evaluations are in metrics.jsonl.
    run = RunDir(run_dir)
    records = run.read_metrics(DIAGNOSTICS) + run.read_metrics()
    privacy = result["privacy"]
    clock = timing(records, 1.0 / privacy["sample_rate"])
    out = {name: result["metrics"][key] for name, key in metric_names.items()}
    out.update(private=privacy["private"], epsilon_rdp=None, epsilon_pld=None)
    if privacy["private"]:
        ledger = read_json(run_dir / "ledger.json")
        out.update(epsilon_rdp=privacy["epsilon"]["rdp"]["epsilon"], epsilon_pld=epsilon_pld(ledger),
                   epsilon=privacy["epsilon"], delta=privacy["delta"], noise_multiplier=privacy["noise_multiplier"],
                   max_grad_norm=privacy["max_grad_norm"], method=privacy.get("method"))
    recipe = (run_dir / "resolved.yaml").read_text()
    out.update(
        run=run_dir.name, recipe=result["recipe"], eval_split=result["eval_split"],
        learning_rate=_recipe_value(recipe, "learning_rate"), sample_rate=privacy["sample_rate"],
        expected_batch_size=privacy["expected_batch_size"], dataset_size=privacy["dataset_size"],
        steps=result.get("steps_run", privacy["steps"]), planned_steps=privacy["steps"],
        selection=result.get("selection"), **clock, wall_seconds=wall_seconds(run, records, clock),
        **machine_and_commit(provenance), precision=arithmetic(recipe, provenance))
    return out


def wall_seconds(run: RunDir, records: list[dict], clock: dict) -> float | None:
    """The logged time of every invocation but the last, plus the last one's whole time (``finished_seconds``),
    plus the final-evaluation batches an interrupted invocation computed and the last one took from the journal."""
    finished = run.finished_seconds()
    if finished is None or not clock:
        return finished
    timed = [r for r in records if "seconds" in r and "split" not in r]
    ends = [r for r in records if r.get("event") == "finished"]
    started = ends[-1].get("start_step") if ends else None
    finished += ends[-1].get("evaluation_reused_seconds", 0.0) if ends else 0.0
    if started is not None and not any(r["step"] > started for r in timed):
        # the finishing invocation resumed at the last step and only evaluated: every logged segment is earlier
        return clock["train_seconds"] + finished
    return clock["train_seconds"] - (timed[-1]["seconds"] if timed else 0.0) + finished


def machine_and_commit(provenance: dict) -> dict:
    machine = f"{provenance['platform']} ({provenance['machine']}), {_cpus(provenance)}"
    if provenance.get("accelerator"):  # recorded since the first GPU runs; absent (CPU) in older provenance
        machine += f", {provenance['accelerator']}"
    return {"machine": machine, "commit": provenance["git_revision"]}


def arithmetic(resolved: str, provenance: dict) -> str:
    """The arithmetic the run trained in: ``train.precision`` as ``dptext finetune`` resolves it (``auto`` is bf16
    on a GPU, by autocast or FSDP's mixed precision; fp32 on a CPU). Results move with it (the audit model's loss AUC:
    0.87 bf16, 0.91 fp32), so an entry says which it is rather than leaving the reader to infer it from the machine."""
    precision = (yaml.safe_load(resolved).get("train") or {}).get("precision", "auto")
    if precision == "auto":
        return "bf16" if provenance.get("accelerator") else "fp32"
    return precision


def _recipe_value(resolved: str, key: str):
    return yaml.safe_load(resolved)["train"][key]


def _cpus(provenance: dict) -> str:
    if provenance.get("cpu_count"):
        return f"{provenance['cpu_count']} CPU cores"
    if provenance["platform"] != platform.platform():  # collected elsewhere: say only what the run recorded
        return "CPU count not recorded"
    return f"{os.cpu_count()} CPU cores"


def pick(candidates: list[Path], metric_names: dict) -> dict | None:
    """The entry of a finished search: the candidate with the best validation value; None while any runs."""
    if not candidates or not all((c / "result.json").is_file() for c in candidates):
        return None
    entries = [entry(c, metric_names) for c in candidates]
    if len(entries) == 1:
        return entries[0]
    if any(e["selection"] is None for e in entries):
        raise SystemExit(f"{candidates}: a search needs each run's validation selection (train.keep_best)")
    metric = entries[0]["selection"]["metric"]
    sign = 1 if metric in LOWER_IS_BETTER else -1
    best = min(entries, key=lambda e: sign * e["selection"]["best_value"])
    best["search"] = {"selected_by": f"best validation {metric} (the test split was not used to choose)",
                      "candidates": [{"run": e["run"], "learning_rate": e["learning_rate"],
                                      f"validation_{metric}": e["selection"]["best_value"]} for e in entries]}
    return best


def pick_tuned(runs: Path, tuned: Tuned, metric_names: dict, committed: dict | None = None) -> dict | None:
    """The final run at the learning rate its tuning runs chose; None until they and that run have finished.
    Tuning runs a fresh machine has lost are read from a committed entry's search over the same runs."""
    tuning = [tuned.tuning.format(lr=lr) for lr in tuned.learning_rates]
    metric = next(iter(metric_names.values()))
    scores = finished_scores(runs, tuning, metric) or committed_scores(committed or {}, tuning, metric)
    if scores is None:
        return None
    final = runs / tuned.final.format(lr=best_of(tuned.learning_rates, scores, metric))
    if not (final / "result.json").is_file():
        return None
    out = entry(final, metric_names)
    out["search"] = {"selected_by": f"{metric} of tuning runs on a split held out of the training set "
                                    "(benchmarks/sst2_tuning_split.py); the reported split was not used to choose",
                     "candidates": [{"run": name, "learning_rate": float(lr), f"tuning_{metric}": score}
                                    for lr, name, score in zip(tuned.learning_rates, tuning, scores)]}
    return out


def committed_scores(committed: dict, tuning: list[str], metric: str) -> list[float] | None:
    """The tuning scores a committed entry recorded for exactly these tuning runs, else None."""
    for entry in committed.values():
        candidates = entry.get("search", {}).get("candidates") or []
        if [c["run"] for c in candidates] == tuning:
            return [c[f"tuning_{metric}"] for c in candidates]
    return None


def collect(runs: Path, results: Path = RESULTS) -> dict[str, dict]:
    """Rewrite each file from the finished runs in `runs`; an entry none of whose runs finished there keeps its
    committed value (a fresh machine has lost the run directories, not the results they produced)."""
    written = {}
    for name, (metric_names, entries) in FILES.items():
        committed = _committed(results, name)
        data = {}
        for key, candidates in entries.items():
            if isinstance(candidates, Tuned):
                found = pick_tuned(runs, candidates, metric_names, committed)
            else:
                found = pick([runs / c for c in candidates], metric_names)
            if found is None:
                found = committed.get(key)
            if found is not None:
                data[key] = found
        written[name] = data
    from collect_distill import collect as collect_distill  # the sibling script (it imports this module)

    written["distill"] = {**_committed(results, "distill"), **collect_distill(runs / DISTILL_CHAIN)}
    written = {name: data for name, data in written.items() if data}
    for name, data in written.items():
        results.mkdir(parents=True, exist_ok=True)
        (results / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    return written


def _committed(results: Path, name: str) -> dict:
    path = results / f"{name}.json"
    return read_json(path) if path.is_file() else {}


def load_results(results: Path = RESULTS) -> dict[str, dict]:
    return {path.stem: read_json(path) for path in sorted(results.glob("*.json"))}


def main(argv: list[str] | None = None) -> int:
    from results_tables import rewrite_readme  # the sibling script; benchmarks/ is not a package

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("collect", help="write the JSON files from run directories, then docs/results.md").add_argument(
        "runs", type=Path, nargs="?", default=Path("/work/results-runs"))
    sub.add_parser("readme", help="rewrite the docs/results.md block from the JSON files")
    args = parser.parse_args(argv)
    if args.command == "collect":
        for name, data in collect(args.runs).items():
            print(f"{RESULTS / name}.json: {', '.join(data)}")
    rewrite_readme(README, load_results())
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
