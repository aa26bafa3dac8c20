"""Time per epoch of non-private training, per-example DP-SGD and eDP-SGD on ATIS and SNIPS (Dupuy et al. Table 2).

Every configuration is the real command (``dptext finetune recipes/{atis,snips}-*.yaml``; with 2 processes
``torchrun --standalone --nproc_per_node 2 -m dptext finetune ...``, gloo on CPU) run for a few steps in a fresh
process. Time per step = the mean wall time of steps 2..S (from the run's diagnostics_not_private.jsonl; step 1
is warm-up, and model loading, σ calibration and evaluation are not timed); time per epoch = time per step × n / B,
the number of steps in one epoch of the recipe at the timing batch B. Configurations are interleaved round-robin (every
repeat runs each once, in a rotated order) so that load from other jobs on a shared machine falls on all alike.

Methods: ``nonprivate``; ``per_sample`` (per-example DP-SGD with instantiated per-example gradients, the opacus
way); ``ghost`` (two backward passes) and ``bookkeeping`` (one backward pass), which compute the same clipped sums;
``edp`` (eDP-SGD, micro-batch clipping). eDP's slots per process are set so that each slot holds about
``--edp-slot-size`` examples, as in recipes/*-edp.yaml at its batch of 256 (16 slots of 16).

    .venv/bin/python benchmarks/bench_nlu_timing.py --data ../shared/data --steps 4 --batch 64
    .venv/bin/python benchmarks/bench_nlu_timing.py --ser-runs runs/atis-nonprivate runs/atis-dpsgd runs/atis-edp

``--ser-runs`` fills the SER column from finished full runs (their result.json); ghost, book-keeping and
per_sample clip identically, so they share the DP-SGD run's SER. Prints a markdown table (and ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dptext.runs import RunDir  # noqa: E402  (after the path: runs from a checkout without installing)

METHODS = {  # method -> (recipe variant, overrides)
    "nonprivate": ("dpsgd", ["privacy.enabled=false"]),  # the same recipe without clipping or noise
    "per_sample": ("dpsgd", ["privacy.clipping_mode=per_sample"]),
    "ghost": ("dpsgd", ["privacy.clipping_mode=ghost"]),
    "bookkeeping": ("dpsgd", ["privacy.clipping_mode=bookkeeping"]),
    "edp": ("edp", []),
}
TRAIN_SIZES = {"atis": 4478, "snips": 13084}
RUN_KINDS = {"nonprivate": ["nonprivate"], "dpsgd": ["per_sample", "ghost", "bookkeeping"], "edp": ["edp"]}


def command(dataset: str, method: str, processes: int, args, out: Path) -> list[str]:
    variant, overrides = METHODS[method]
    if method == "edp":
        slots = max(1, round(args.batch / processes / args.edp_slot_size))
        overrides = overrides + [f"privacy.edp_micro_batches_per_device={slots}"]
    finetune = ["finetune", str(ROOT / "recipes" / f"{dataset}-{variant}.yaml"),
                f"data.path={Path(args.data) / dataset}", f"train.batch_size={args.batch}",
                f"train.max_steps={args.steps}", "train.log_every=1", "data.max_eval_examples=8",
                f"name={dataset}-{method}-{processes}p", *overrides, "--out", str(out), "--json"]
    if processes == 1:
        return [sys.executable, "-m", "dptext", *finetune]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [torchrun, "--standalone", f"--nproc_per_node={processes}", "-m", "dptext", *finetune]


def time_one(dataset: str, method: str, processes: int, args, scratch: Path) -> dict:
    out = scratch / f"{dataset}-{method}-{processes}p-{time.monotonic_ns()}"
    started = time.monotonic()
    # One intra-op thread per process in every configuration (torchrun's own default for several processes):
    # on a shared, oversubscribed CPU, multi-threaded barriers inflate 1-process times more than 2-process ones.
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command(dataset, method, processes, args, out), cwd=ROOT, capture_output=True, text=True,
                          env=env)
    wall = time.monotonic() - started
    if done.returncode != 0:
        return {"status": "failed", "error": done.stderr.strip().splitlines()[-1:] or ["?"], "wall_s": wall}
    # per-step wall time is an un-noised diagnostic (it grows with the realised batch): it lives apart from
    # metrics.jsonl, in the not-covered diagnostics file
    steps = [json.loads(line) for line in (out / "diagnostics_not_private.jsonl").read_text().splitlines()]
    seconds = [r["seconds"] for r in steps if "seconds" in r]  # not the run's "finished" total
    result = json.loads((out / "result.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    step_s = (seconds[-1] - seconds[0]) / (len(seconds) - 1)  # steps 2..S
    return {"status": "ok", "step_s": step_s, "wall_s": wall, "sample_rate": result["privacy"]["sample_rate"]}


def target_epsilon(dataset: str, method: str) -> float | None:
    """The ε the full recipe is calibrated to (None for the non-private one)."""
    from dptext.config import load_recipe

    if method == "nonprivate":
        return None
    return load_recipe(ROOT / "recipes" / f"{dataset}-{METHODS[method][0]}.yaml").privacy.target_epsilon


def load() -> str:
    return " ".join(os.getloadavg().__repr__().strip("()").split(", "))


def ser_by_method(run_dirs: list[str]) -> dict[tuple[str, str], dict]:
    """(dataset, method) -> {ser, epsilon} of finished full runs; the DP-SGD run stands for every clipping mode."""
    found = {}
    for run_dir in run_dirs:
        if not (Path(run_dir) / "result.json").exists():
            continue
        result = json.loads((Path(run_dir) / "result.json").read_text())
        resolved = result["privacy"]
        dataset, kind = result["recipe"].split("-", 1)  # run names: atis-nonprivate, atis-dpsgd, atis-edp
        eps = resolved.get("epsilon", {}).get("rdp", {}).get("epsilon") if resolved["private"] else None
        entry = {"ser": result["metrics"]["ser"], "epsilon": eps, "n": resolved["dataset_size"]}
        for method in RUN_KINDS.get(kind, []):
            found[(dataset, method)] = entry
    return found


def add_ser(rows: list[dict], ser: dict) -> None:
    for row in rows:
        row.update(ser.get((row["dataset"], row["method"]), {}))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    parser.add_argument("--datasets", nargs="+", default=["atis", "snips"])
    parser.add_argument("--methods", nargs="+", default=["nonprivate", "per_sample", "bookkeeping", "edp"],
                        choices=list(METHODS))
    parser.add_argument("--processes", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--steps", type=int, default=4, help="steps per run; steps 2..S are timed")
    parser.add_argument("--batch", type=int, default=64, help="expected batch B of the timing runs")
    parser.add_argument("--edp-slot-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    parser.add_argument("--ser-runs", nargs="*", default=[])
    parser.add_argument("--ser-table", nargs="+", metavar="RUN_DIR",
                        help="only print SER, intent accuracy, slot F1 and ε of these finished runs")
    parser.add_argument("--merge", help="a saved --json report whose timings this run's repeats add to")
    parser.add_argument("--report", help="re-render a saved --json report (with --ser-runs) instead of timing")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (step 1 is warm-up)")

    if args.ser_table:
        print(ser_table(args.ser_table))
        return {}
    if args.report:
        report = json.loads(Path(args.report).read_text())
        add_ser(report["rows"], ser_by_method(args.ser_runs))
        print(json.dumps(report, indent=1) if args.json else markdown(report))
        return report
    configs = [(d, m, p) for d in args.datasets for p in args.processes for m in args.methods]
    times: dict[tuple, list[float]] = {c: [] for c in configs}
    failures: dict[tuple, str] = {}
    loads = [load()]
    repeats = args.repeats
    if args.merge:  # earlier repeats of the same configurations (same B and steps)
        earlier = json.loads(Path(args.merge).read_text())
        if (earlier["batch"], earlier["steps"]) != (args.batch, args.steps):
            parser.error("--merge needs a report with the same --batch and --steps")
        for row in earlier["rows"]:
            times.setdefault((row["dataset"], row["method"], row["processes"]), []).extend(row["step_s"])
        loads = earlier["load_average_1_5_15"] + loads
        repeats += earlier["repeats"]
    with tempfile.TemporaryDirectory(prefix="bench-nlu-") as scratch:
        for repeat in range(args.repeats):
            shift = (repeat + repeats - args.repeats) % len(configs)  # merged repeats keep rotating the order
            order = configs[shift:] + configs[:shift]
            for config in order:
                outcome = time_one(*config, args, Path(scratch))
                if outcome["status"] == "ok":
                    times[config].append(outcome["step_s"])
                else:
                    failures[config] = " ".join(outcome["error"])
                print(f"[{repeat + 1}/{args.repeats}] {config}: {outcome}", file=sys.stderr, flush=True)
                loads.append(load())
    rows = []
    configs = list(times)
    for dataset, method, processes in configs:
        measured = times[(dataset, method, processes)]
        epoch_s = statistics.mean(measured) * TRAIN_SIZES[dataset] / args.batch if measured else None
        rows.append({"dataset": dataset, "method": method, "processes": processes, "epoch_s": epoch_s,
                     "step_s": measured, "failed": failures.get((dataset, method, processes)),
                     "epsilon": target_epsilon(dataset, method)})
    add_ser(rows, ser_by_method(args.ser_runs))
    for row in rows:
        base = next(r for r in rows if r["dataset"] == row["dataset"] and r["processes"] == row["processes"]
                    and r["method"] == "nonprivate")
        row["vs_nonprivate"] = row["epoch_s"] / base["epoch_s"] if row["epoch_s"] and base["epoch_s"] else None
    report = {"rows": rows, "load_average_1_5_15": loads, "steps": args.steps, "batch": args.batch,
              "repeats": repeats, "cpus": os.cpu_count(), "threads_per_process": args.threads}
    print(json.dumps(report, indent=1) if args.json else markdown(report))
    return report


def ser_table(run_dirs: list[str]) -> str:
    lines = ["| run | n (train) | steps | ε (RDP) | δ | SER (%) | intent acc (%) | slot F1 | minutes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run_dir in run_dirs:
        path = Path(run_dir) / "result.json"
        if not path.exists():
            continue
        result = json.loads(path.read_text())
        privacy, scores = result["privacy"], result["metrics"]
        eps = f"{privacy['epsilon']['rdp']['epsilon']:.2f}" if privacy["private"] else "∞ (non-private)"
        delta = f"{privacy['delta']:.0e}" if privacy["private"] else "—"
        lines.append(f"| {result['recipe']} | {privacy['dataset_size']} | {privacy['steps']} | {eps} | {delta} | "
                     f"{scores['ser']:.2f} | {scores['intent_acc']:.2f} | {scores['slot_f1']:.2f} | "
                     f"{RunDir(run_dir).finished_seconds() / 60:.1f} |")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    def fmt(value, spec):
        return "—" if value is None else format(value, spec)

    lines = ["| dataset | method | processes | time/epoch (s) | × non-private | ε (δ=5e-4) | SER (%) |",
             "|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        eps = "∞ (none)" if row["method"] == "nonprivate" else fmt(row.get("epsilon"), ".2f")
        timing = fmt(row["epoch_s"], ".0f") if not row["failed"] else f"failed: {row['failed'][:60]}"
        lines.append(f"| {row['dataset']} | {row['method']} | {row['processes']} | {timing} | "
                     f"{fmt(row['vs_nonprivate'], '.2f')} | {eps} | {fmt(row.get('ser'), '.2f')} |")
    one_minute = sorted(float(entry.split()[0]) for entry in report["load_average_1_5_15"])
    notes = []
    notes.append(f"Timing runs: B = {report['batch']}, steps 2..{report['steps']} timed, {report['repeats']} "
                 f"repeat(s) interleaved, {report['cpus']} CPUs, {report['threads_per_process']} thread(s) "
                 "per process; "
                 f"1-min load average around the runs: min {one_minute[0]:.1f}, median "
                 f"{statistics.median(one_minute):.1f}, max {one_minute[-1]:.1f}.")
    sizes = sorted({row["n"] for row in report["rows"] if row.get("n")})
    if sizes:
        notes.append(f"SER comes from the full runs given with --ser-runs (trained on n = "
                     f"{', '.join(map(str, sizes))} examples), not from the timing runs; per_sample, ghost and "
                     "bookkeeping compute the same clipped sums, so they share the DP-SGD run's SER.")
    return "\n".join(lines + [""] + [part for note in notes for part in textwrap.wrap(note, 116)])


if __name__ == "__main__":
    main()
