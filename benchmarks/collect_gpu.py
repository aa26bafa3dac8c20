"""Collect a GPU check's $OUT (benchmarks/device/gpu_check.sh) into benchmarks/results/bench_gpu.json; print its tables.

    python benchmarks/collect_gpu.py OUTDIR                   # a GPU run -> benchmarks/results/bench_gpu.json
    python benchmarks/collect_gpu.py OUTDIR --out FILE.json   # anything, the CPU rehearsal too, elsewhere
    python benchmarks/collect_gpu.py OUT1 OUT2 ...            # several runs (gpu_check.sh --only): merged

Several OUTDIRs are merged in order, a later run's parts replacing the earlier ones': the exactness cells whole,
each bench-memory (T, B) whole, the scale step whole, so that every table still compares numbers of one run on one
device; ``parts`` names each part's commit and device. Scale rows of a later run at the same commit on the same
device are added to the earlier ones instead (more layer counts), and so are those of a folder that holds only a
max_model.json (``max_model.py --layers ...`` run by hand on the same machine right after the check).

OUTDIR holds meta.json, exactness.json, bench.json and max_model.json (the last from the log's rows when the
scale step was cut off before writing it). The result names the device and the commit, and keeps every exactness
cell, every bench-memory row and every max-model row. Printed in Markdown: step time and peak memory of each mode
as ratios to non-private training and to opacus (its ghost clipping refuses the tied SmolLM2, so its untied copy
stands in, as the header says), the largest batch; the largest model non-private vs DP; the exactness cells
exact / refused / FAILED per precision and mode, with the worst errors against their tolerances.

A CPU rehearsal (or a --tiny run) is refused as benchmarks/results/bench_gpu.json: that file holds GPU numbers only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dptext.runs import atomic_write_json  # noqa: E402  (runs from a checkout without installing)

from gpu_tables import markdown  # noqa: E402  (its neighbour in benchmarks/, not a package)

RESULT = REPO / "benchmarks" / "results" / "bench_gpu.json"


def read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def scale_from_log(log: Path) -> dict | None:
    """max_model.py's rows as its log printed them, for a scale step cut off before it wrote its JSON."""
    if not log.exists():
        return None
    rows = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith('{"mode"') and '"layers"' in line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    largest = {}
    for row in rows:
        if row.get("fits") and row["layers"] > largest.get(row["mode"], {}).get("layers", 0):
            largest[row["mode"]] = {"layers": row["layers"], "parameters": row["parameters"]}
    return {"rows": rows, "largest": largest, "from_log": True} if rows else None


def exactness_summary(exactness: dict | None) -> dict:
    if exactness is None:
        return {"cells": 0, "exact": 0, "refused": 0, "FAILED": 0, "by": []}
    cells = exactness["cells"]
    by = []
    for precision in dict.fromkeys(cell["precision"] for cell in cells):
        for mode in dict.fromkeys(cell["mode"] for cell in cells):
            group = [c for c in cells if c["precision"] == precision and c["mode"] == mode]
            if not group:
                continue
            measured = [c for c in group if "max_error" in c]
            worst = {what: max((c["max_error"][what] for c in measured), default=None)
                     for what in ("norms", "sum", "layer")}
            by.append({"precision": precision, "mode": mode, "tolerance": exactness["setup"]["tolerance"][precision],
                       **{outcome: sum(c["outcome"] == outcome for c in group)
                          for outcome in ("exact", "refused", "FAILED")},
                       "worst": worst, "worst_sensitivity_c": max((c["sensitivity_c"] for c in measured),
                                                                  default=None)})
    return {"cells": len(cells), **{outcome: sum(c["outcome"] == outcome for c in cells)
                                    for outcome in ("exact", "refused", "FAILED")},
            "proof_ran": sum(bool(c.get("proof_ran")) for c in cells), "planned": exactness["setup"].get("planned"),
            "by": by}


def with_opacus_ratios(report: dict) -> dict:
    """The report's rows with ``opacus_time_ratio`` / ``opacus_memory_ratio`` against opacus (else its untied
    copy); ``opacus_reference`` says which."""
    rows = {row["mode"]: row for row in report["results"]}
    reference = next((rows[m] for m in ("opacus", "opacus_untied") if rows.get(m, {}).get("status") == "ok"), None)
    results = []
    for row in report["results"]:
        row = dict(row)
        if reference is not None and row["status"] == "ok":
            row.update(opacus_reference=reference["mode"], opacus_time_ratio=row["step_s"] / reference["step_s"],
                       opacus_memory_ratio=row["peak_mb"] / reference["peak_mb"])
        results.append(row)
    return dict(report, results=results)


def collect(out_dir: Path) -> dict:
    if not (out_dir / "meta.json").exists():  # more scale rows of the run before it (module docstring)
        return {"scale_only": True, "scale": read(out_dir / "max_model.json")}
    meta = json.loads((out_dir / "meta.json").read_text())
    exactness = read(out_dir / "exactness.json")
    scale = read(out_dir / "max_model.json") or scale_from_log(out_dir / "log.txt")
    bench = read(out_dir / "bench.json") or {"runs": []}
    return {"what": "issue 44's GPU check (benchmarks/device/gpu_check.sh): exactness against fp64 brute force, "
                    "dptext bench-memory against non-private and opacus, the largest model non-private vs DP",
            "device": meta.get("device_name") or meta["device"], "tiny": meta["tiny"],
            "rehearsal": meta["device"] != "cuda" or meta["tiny"],
            "commit": meta["provenance"]["git_revision"], "nvidia_smi": meta.get("nvidia_smi"),
            "torch": meta["torch"], "cuda": meta.get("cuda"), "packages": meta["provenance"]["packages"],
            "smollm2_weights": meta.get("smollm2_weights"), "steps": meta["steps"],
            "exactness": {"summary": exactness_summary(exactness), "setup": (exactness or {}).get("setup"),
                          "cells": (exactness or {}).get("cells", [])},
            "bench": [with_opacus_ratios(report) for report in bench["runs"]],
            "scale": scale, "profile": read(out_dir / "profile.json"), "finetune": finetune(out_dir / "finetune")}


def finetune(folder: Path) -> dict | None:
    """The opt-in finetune step's run (gpu_check.sh --only finetune): what it trained, its ε, its metrics, the
    micro-batch the memory probe picked and its step times."""
    result = read(folder / "result.json")
    if result is None:
        return None
    privacy = result["privacy"]
    metrics = folder / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    return {"model": result["model"], "task": result["task"], "metrics": result["metrics"],
            "steps": result["steps_run"], "physical_batch_size": result["physical_batch_size"],
            "expected_batch_size": privacy.get("expected_batch_size"), "dataset_size": result["dataset_size"],
            "epsilon": privacy["epsilon"][privacy["accountant"]]["epsilon"], "delta": privacy["delta"],
            "clipping_mode": privacy.get("clipping_mode"), "training_records": len(steps)}


def bench_key(report: dict) -> str:
    """The gpu_check.sh step that made a bench-memory report: bench-T<seq len>-B<batch>."""
    return f"bench-T{report['setup']['seq_len']}-B{report['setup']['batch_size']}"


def with_rows(scale: dict, more: dict) -> dict:
    """``scale`` with ``more``'s rows added (a (mode, layers) measured again: the later row) and its largest redone."""
    rows = {(row["mode"], row["layers"]): row for row in scale["rows"] + more["rows"]}
    largest = {}
    for (mode, layers), row in sorted(rows.items(), key=lambda item: item[0][1]):
        if row.get("fits"):
            largest[mode] = {"layers": layers, "parameters": row["parameters"]}
    return dict(scale, rows=list(rows.values()), largest=largest)


def merged(results: list[dict]) -> dict:
    """``results`` (oldest first) as one: each part from the newest run that has it (module docstring)."""
    result, parts = dict(results[0], bench=[]), {}
    for run in results:
        if run.get("scale_only"):
            result["scale"] = with_rows(result["scale"], run["scale"])
            continue
        stamp = {"commit": run["commit"], "device": run["device"], "torch": run["torch"]}
        if run["exactness"]["cells"]:
            result["exactness"], parts["exactness"] = run["exactness"], stamp
        for report in run["bench"]:
            result["bench"] = [r for r in result["bench"] if bench_key(r) != bench_key(report)] + [report]
            parts[bench_key(report)] = stamp
        if run["scale"] is not None:
            same = parts.get("scale", {}).get("commit") == run["commit"] and parts["scale"]["device"] == run["device"]
            result["scale"] = with_rows(result["scale"], run["scale"]) if same else run["scale"]
            parts["scale"] = stamp
        for part in ("profile", "finetune"):
            if run.get(part) is not None:
                result[part], parts[part] = run[part], stamp
        result["steps"] = {**result["steps"], **run["steps"]}
    newest = [run for run in results if not run.get("scale_only")][-1]
    result.update(commit=newest["commit"], device=newest["device"], torch=newest["torch"], cuda=newest.get("cuda"),
                  rehearsal=any(run.get("rehearsal") for run in results), tiny=any(run.get("tiny") for run in results))
    if len(results) > 1:
        result["parts"] = parts
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dirs", type=Path, nargs="+", help="the $OUT of benchmarks/device/gpu_check.sh "
                        "(several: merged in order, later parts replacing earlier ones)")
    parser.add_argument("--out", type=Path, default=RESULT, help=f"where to write (default {RESULT})")
    args = parser.parse_args(argv)
    for index, out_dir in enumerate(args.out_dirs):
        if not (out_dir / "meta.json").exists() and not (index and (out_dir / "max_model.json").exists()):
            print(f"{out_dir} holds no meta.json, so it is not a GPU check's output; pass the $OUT folder of "
                  "benchmarks/device/gpu_check.sh.", file=sys.stderr)
            return 2
    result = merged([collect(out_dir) for out_dir in args.out_dirs])
    if result["rehearsal"] and args.out.resolve() == RESULT.resolve():
        what = f"device {result['device']}" + (", tiny models" if result["tiny"] else "")
        folders = " ".join(map(str, args.out_dirs))
        print(f"{folders} holds a rehearsal ({what}), not a GPU run, so it is not written to "
              f"{RESULT.relative_to(REPO)}; pass --out elsewhere to collect it.", file=sys.stderr)
        return 2
    atomic_write_json(args.out, result)
    print(markdown(result))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
