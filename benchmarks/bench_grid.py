"""The cost of private training over a grid of shapes: T ∈ {32, 64, 128, 256}, B ∈ {8, 32}, two models (issue 19).

    python benchmarks/bench_grid.py                       # the full grid → benchmarks/results/bench_cpu_grid.json
    python benchmarks/bench_grid.py --seq-lens 32,64 --batch-sizes 8 --out slice.json
    python benchmarks/bench_grid.py --table benchmarks/results/bench_cpu_grid.json   # print the table
    python benchmarks/bench_grid.py --readme benchmarks/results/bench_cpu_grid.json  # put it into docs/performance.md

Each cell (model, T, B) runs its modes round-robin, every mode in a fresh subprocess (dptext.bench.measure_mode:
the median step time with the allocator as ``dptext finetune`` sets it, dptext.allocator; the peak RSS of a second
subprocess that returns freed memory to the OS, see dptext.bench.MEMORY_ENV), and appends its rows to the JSON as
soon as it is done, so an interrupted grid resumes where it stopped: finished cells are skipped. Every row carries
the machine, date, commit and the load average around its cell, since on a shared machine the ratios are only as
good as the load was even. opacus refuses tied embeddings, so SmolLM2 runs it on an untied copy (``opacus_untied``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dptext import bench  # noqa: E402  (after the path: runs from a checkout without installing)
from dptext.runs import atomic_write, atomic_write_json  # noqa: E402

MODELS = {"smollm2-135m": ("causal_lm", ("nonprivate", "bookkeeping", "ghost", "opacus_untied")),
          "minilm-l6": ("sequence_classification", ("nonprivate", "bookkeeping", "ghost", "opacus"))}
SEQ_LENS, BATCH_SIZES = (32, 64, 128, 256), (8, 32)
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "bench_cpu_grid.json"
BEGIN, END = "<!-- bench-grid:begin (benchmarks/bench_grid.py --readme) -->", "<!-- bench-grid:end -->"
LABELS = {"nonprivate": "non-private", "bookkeeping": "book-keeping", "ghost": "ghost",
          "opacus": "opacus 1.6", "opacus_untied": "opacus 1.6 (untied copy)"}


def load_average() -> float:
    return os.getloadavg()[0]


def commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def read_rows(path: Path) -> list[dict]:
    import json

    return json.loads(path.read_text()) if path.exists() else []


def finished(rows: list[dict], model: str, seq_len: int, batch_size: int) -> bool:
    return any(r["model"] == model and r["seq_len"] == seq_len and r["batch_size"] == batch_size for r in rows)


def measure_cell(model: str, seq_len: int, batch_size: int, steps: int, warmup: int, rounds: int) -> list[dict]:
    """One cell's rows: its modes round-robin ``rounds`` times, ratios to the non-private run of the same cell."""
    head, modes = MODELS[model]
    spec = {"model": model, "head": head, "seq_len": seq_len, "batch_size": batch_size, "device": "cpu",
            "precision": "fp32", "steps": steps, "warmup": warmup, "max_batch": False}
    load_before, measured_commit = load_average(), commit()  # the code the cell starts with
    per_mode: dict[str, list[dict]] = {mode: [] for mode in modes}
    for round_index in range(rounds):
        for mode in modes:
            per_mode[mode].append(bench.measure_mode(dict(spec, mode=mode), with_memory=round_index == 0))
    results = [bench.merge_rounds(per_mode[mode]) for mode in modes]
    bench.add_ratios(results)
    context = {"machine": bench.machine_description("cpu"), "date": datetime.date.today().isoformat(),
               "commit": measured_commit, "load_average": [round(load_before, 2), round(load_average(), 2)],
               "steps": steps * rounds}
    return [{"model": model, "seq_len": seq_len, "batch_size": batch_size, "mode": r["mode"], "status": r["status"],
             "time_s": r.get("step_s"), "peak_mb": r.get("peak_mb"),
             "peak_mb_timed_run": r.get("peak_mb_timed_run"), "time_ratio": r.get("time_ratio"),
             "memory_ratio": r.get("memory_ratio"), "noise_s": r.get("noise_s"), **context} for r in results]


def run_grid(path: Path, models, seq_lens, batch_sizes, steps: int, warmup: int, rounds: int, say=print) -> list[dict]:
    rows = read_rows(path)
    for model in models:
        for batch_size in batch_sizes:
            for seq_len in seq_lens:
                if finished(rows, model, seq_len, batch_size):
                    say(f"skip {model} T={seq_len} B={batch_size} (already in {path.name})")
                    continue
                rows.extend(measure_cell(model, seq_len, batch_size, steps, warmup, rounds))
                atomic_write_json(path, rows)
                say(render_table([r for r in rows if r["model"] == model and r["seq_len"] == seq_len
                                  and r["batch_size"] == batch_size]))
    return rows


def _ratio(row: dict, key: str) -> str:
    return "—" if row.get(key) is None else f"{row[key]:.2f}×"


def render_table(rows: list[dict]) -> str:
    """Markdown: one line per cell and mode, time and peak RSS with their ratios to non-private."""
    lines = ["| model | T | B | mode | step time (s) | × non-private | of which noise (s) | peak RSS (MB) "
             "| × non-private | load |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["model"], r["batch_size"], r["seq_len"])):
        if r["status"] != "ok":
            cells = [r["status"][:80], "", "", "", ""]
        else:
            noise = "—" if r.get("noise_s") is None else f"{r['noise_s']:.3f}"
            cells = [f"{r['time_s']:.2f}", _ratio(r, "time_ratio"), noise, f"{r['peak_mb']:.0f}",
                     _ratio(r, "memory_ratio")]
        load = "–".join(f"{value:.1f}" for value in r.get("load_average", []))
        lines.append("| " + " | ".join([r["model"], str(r["seq_len"]), str(r["batch_size"]),
                                        LABELS.get(r["mode"], r["mode"]), *cells, load]) + " |")
    machines = sorted({f"{r['machine']}, {r['date']}, commit {r['commit']}" for r in rows})
    return "\n".join(lines + ["", "Measured on " + "; ".join(machines) + "."])


def rewrite_readme(readme: Path, rows: list[dict], source: Path) -> None:
    """Put the table of ``rows`` between the grid markers of docs/performance.md (regenerated after a full run)."""
    text = readme.read_text()
    start, end = text.index(BEGIN), text.index(END)
    try:
        shown = source.resolve().relative_to(ROOT)
    except ValueError:
        shown = source
    caveat = " (measured while the machine was shared: read the load column)" if "contended" in source.name \
        else ""
    block = f"{BEGIN}\nFrom `{shown}`{caveat}:\n\n{render_table(rows)}\n"
    readme.write_text(text[:start] + block + text[end:])


def write_plot(rows: list[dict], path: Path) -> None:
    """Time and memory ratio against T, one line per model, batch size and private mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    series = sorted({(r["model"], r["batch_size"], r["mode"]) for r in rows
                     if r["mode"] != "nonprivate" and r.get("time_ratio") is not None})
    for model, batch_size, mode in series:
        points = sorted((r["seq_len"], r["time_ratio"], r["memory_ratio"]) for r in rows
                        if (r["model"], r["batch_size"], r["mode"]) == (model, batch_size, mode)
                        and r.get("time_ratio") is not None)
        style = "-" if mode == "bookkeeping" else "--"
        for axis, index in ((axes[0], 1), (axes[1], 2)):
            axis.plot([p[0] for p in points], [p[index] for p in points], style, marker="o",
                      label=f"{model} B={batch_size} {LABELS.get(mode, mode)}")
    for axis, title in ((axes[0], "step time / non-private"), (axes[1], "peak RSS / non-private")):
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("sequence length T")
        axis.set_title(title)
    axes[1].legend(fontsize=6)
    figure.tight_layout()
    atomic_write(path, lambda handle: figure.savefig(handle, format="png", dpi=120), binary=True)
    plt.close(figure)


def _numbers(text: str) -> tuple[int, ...]:
    return tuple(int(value) for value in text.split(",") if value.strip())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--seq-lens", default=",".join(map(str, SEQ_LENS)))
    parser.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "bench_cpu_grid.png")
    parser.add_argument("--table", type=Path, help="only print the Markdown table of this grid file")
    parser.add_argument("--readme", type=Path, help="only write the table of this grid file into docs/performance.md")
    args = parser.parse_args(argv)
    if args.table:
        print(render_table(read_rows(args.table)))
        return
    if args.readme:
        rewrite_readme(ROOT / "docs" / "performance.md", read_rows(args.readme), args.readme)
        return
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    rows = run_grid(args.out, models, _numbers(args.seq_lens), _numbers(args.batch_sizes), args.steps, args.warmup,
                    args.rounds, say=lambda text: print(text, flush=True))
    write_plot(rows, args.plot)
    print(render_table(rows))


if __name__ == "__main__":
    main()
