"""``dptext bench-memory``: the cost of private training, side by side in one invocation.

For one model, sequence length T and batch size B, every mode runs in a fresh subprocess (so peak memory is
its own): non-private training, our three clipping modes, and opacus' ghost clipping when opacus is installed.
Each reports the median step time over repeated steps after warm-up (over several round-robin rounds with
``rounds`` > 1) and the peak memory (GPU:
``torch.cuda.max_memory_allocated``; CPU: the peak RSS of a second, short subprocess that returns every freed
block to the OS, and that peak minus the RSS after loading the model, i.e. what the training step itself
needs; see ``MEMORY_ENV``). On GPU each mode also finds its largest
batch by doubling and then bisecting until CUDA runs out of memory. Ratios are to the non-private run.

opacus refuses tied embeddings in ghost-clipping mode, so on a tied model its row says "unsupported" with
opacus' own reason, and a second row runs opacus on an explicitly untied copy (one more V×d matrix to
train) so that a time comparison exists; that row is labelled as such.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from dptext.allocator import keep_freed_memory
from dptext.bench_step import CORRELATED, OURS, measure
from dptext.runs import atomic_write

MODES = ("nonprivate",) + OURS + CORRELATED + ("opacus", "opacus_untied")


# ---------------------------------------------------------------------------- the parent process

# The clock runs with the C allocator set as ``dptext finetune`` sets it (``dptext.allocator``: freed memory stays
# in the heap). CPU peak memory is read in a second, short subprocess with a fixed mmap threshold: glibc then
# returns every freed block over 128 KiB to the OS, so the peak RSS is the peak of live memory, not of heap
# fragmentation. That regime must not be the one timed: every new tensor then costs a page fault per 4 KiB page,
# about 30 % of a step in kernel time on a 2-core CPU, and more for the modes that allocate more, so it inflated
# both the step times and their ratios.
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
MEMORY_STEPS = {"warmup": 1, "steps": 1}  # the peak of a step after the first: buffers built lazily count


def _run_in_subprocess(spec: dict, env: dict | None = None) -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "dptext.bench", json.dumps(spec)], capture_output=True,
                          text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        if proc.returncode == -9:  # SIGKILL leaves no traceback: on Linux, almost always the OOM killer
            reason = "killed (SIGKILL), most likely out of memory"
        return {"mode": spec["mode"], "status": f"failed: {reason[:300]}"}
    return json.loads(lines[-1])


def measure_mode(spec: dict, with_memory: bool) -> dict:
    """One mode, one round: the timed subprocess and, on CPU when ``with_memory``, the memory subprocess whose
    peak RSS becomes ``peak_mb``/``step_mb``. The timed run's own peak (freed memory kept, as ``dptext finetune``
    runs: fragmentation included) is kept as ``peak_mb_timed_run``; a round without the memory run reports only
    that."""
    timed = _run_in_subprocess(spec)
    if spec["device"] != "cpu" or timed["status"] != "ok":
        return timed
    timed["peak_mb_timed_run"] = timed.pop("peak_mb")
    timed.pop("step_mb", None)
    if not with_memory:
        return timed
    memory = _run_in_subprocess(dict(spec, **MEMORY_STEPS), MEMORY_ENV)
    if memory["status"] != "ok":
        return memory
    return dict(timed, peak_mb=memory["peak_mb"], step_mb=memory["step_mb"])


def add_ratios(results: list[dict]) -> None:
    baseline = next((r for r in results if r["mode"] == "nonprivate" and r["status"] == "ok"), None)
    for result in results:
        if baseline is None or result["status"] != "ok":
            continue
        result["time_ratio"] = result["step_s"] / baseline["step_s"]
        result["memory_ratio"] = result["peak_mb"] / baseline["peak_mb"]
        if "step_mb" in result and baseline.get("step_mb", 0) > 0:
            result["step_memory_ratio"] = result["step_mb"] / baseline["step_mb"]


def merge_rounds(rounds: list[dict]) -> dict:
    """One mode's result over several rounds: all step times (median), the largest peak."""
    failed = next((r for r in rounds if r["status"] != "ok"), None)
    if failed is not None:
        return failed
    merged = dict(rounds[0], times_s=[t for r in rounds for t in r["times_s"]])
    merged["step_s"] = statistics.median(merged["times_s"])
    if all("noise_times_s" in r for r in rounds):
        merged["noise_times_s"] = [t for r in rounds for t in r["noise_times_s"]]
        merged["noise_s"] = statistics.median(merged["noise_times_s"])
    for key in ("peak_mb", "step_mb", "peak_mb_timed_run", "max_batch"):
        values = [r[key] for r in rounds if key in r]
        if values:
            merged[key] = max(values)
    return merged


def run(model: str, seq_len: int, batch_size: int, device: str = "auto", steps: int = 5, warmup: int = 2,
        modes: tuple[str, ...] = MODES, precision: str = "auto", max_batch: bool = True, rounds: int = 1,
        progress=None) -> dict:
    """Benchmark every mode; returns {"setup": ..., "results": [one dict per mode]}.

    With ``rounds`` > 1 the modes run round-robin that many times and each reports the median over all its
    timed steps: on a shared machine, load that comes and goes then hits every mode alike."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if precision == "auto":
        precision = "bf16" if device.startswith("cuda") else "fp32"
    setup = {"model": model, "seq_len": seq_len, "batch_size": batch_size, "device": device,
             "precision": precision, "steps": steps, "warmup": warmup, "rounds": rounds,
             "machine": machine_description(device)}
    per_mode: dict[str, list[dict]] = {mode: [] for mode in modes}
    for round_index in range(rounds):
        for mode in modes:
            search = max_batch and device.startswith("cuda") and round_index == 0
            per_mode[mode].append(measure_mode(dict(setup, mode=mode, max_batch=search), round_index == 0))
            if progress is not None:
                progress(mode, per_mode[mode][-1])
    results = [merge_rounds(per_mode[mode]) for mode in modes]
    add_ratios(results)
    return {"setup": setup, "results": results}


def machine_description(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores "
            f"({torch.get_num_threads()} torch threads), torch {torch.__version__}")


def write_chart(report: dict, path: Path) -> None:
    """Bar chart of step time and peak memory relative to non-private training."""
    import matplotlib  # optional dependency (opacus) or plotting only (matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency (opacus) or plotting only (matplotlib)

    rows = [r for r in report["results"] if "time_ratio" in r]
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for axis, key, title in ((axes[0], "time_ratio", "step time"), (axes[1], "memory_ratio", "peak memory")):
        axis.bar([r["mode"] for r in rows], [r[key] for r in rows], color="#4c72b0")
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_title(f"{title} / non-private")
        axis.tick_params(axis="x", rotation=30)
    setup = report["setup"]
    figure.suptitle(f"{setup['model']}, T={setup['seq_len']}, batch {setup['batch_size']}, {setup['device']}")
    figure.tight_layout()
    atomic_write(path, lambda handle: figure.savefig(handle, format="png", dpi=120), binary=True)
    plt.close(figure)


if __name__ == "__main__":
    keep_freed_memory()  # timed as `dptext finetune` runs; MEMORY_ENV's subprocess keeps its own setting
    print(json.dumps(measure(json.loads(sys.argv[1]))))
