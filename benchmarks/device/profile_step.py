"""Where a DP step's time goes on the device, against non-private training: torch.profiler over a few steps.

    python benchmarks/device/profile_step.py --device cuda [--model smollm2-135m] [--seq-len 256]
        [--batch-size 8] [--modes nonprivate,bookkeeping,ghost] [--steps 3] [--out profile.json]

The first GPU check (H200, SmolLM2-135M, bf16 autocast, T = 256, B = 8) measured book-keeping at 2.34× the
non-private step time, against 1.24× on this project's CPU at the same shape: the difference is the device's, and
this says whether it is kernel time (the norms' and sums' arithmetic), kernel launches (many small kernels per
layer, a launch-bound step) or host synchronisations (the CPU waiting on the device). Each mode's step is
``dptext bench-memory``'s (``dptext.bench_step``: the same engine, batch and autocast), warmed up, then profiled
for ``--steps`` steps. Per mode: wall seconds per step, device (kernel) seconds per step and its share of the wall
time, kernel launches per step, host synchronisations per step (``cudaStreamSynchronize`` /
``cudaDeviceSynchronize`` / ``cudaMemcpy`` device-to-host calls the profiler sees), and the 15 operators with the
most self device time and with the most self CPU time. On the CPU (the rehearsal, tests/test_gpu_check.py) the
device columns are absent and the CPU operators are what is listed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from dptext.bench_step import _batch, _make_step, _synchronize  # noqa: E402  (runs from a checkout)
from dptext.models import load_model  # noqa: E402
from dptext.runs import atomic_write_json  # noqa: E402

TOP = 15
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def device_seconds(event) -> float:
    """An event's self time on the device, in seconds (the attribute's name changed across torch versions)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return getattr(event, name) / 1e6
    return 0.0


def profile_mode(mode: str, model, ids, mask, device: torch.device, steps: int, autocast) -> dict:
    from torch.profiler import ProfilerActivity, profile

    step, close = _make_step(mode, model, len(ids))
    try:
        with autocast:
            for _ in range(2):  # warm-up: Adam's state, the allocator, kernels chosen
                step(ids, mask)
            _synchronize(device)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=activities) as prof:
                start = time.perf_counter()
                for _ in range(steps):
                    step(ids, mask)
                _synchronize(device)
                wall = (time.perf_counter() - start) / steps
    finally:
        close()
        model.zero_grad(set_to_none=True)
    events = prof.key_averages()
    row = {"mode": mode, "wall_s": wall}
    if device.type == "cuda":
        kernels = [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        row["device_s"] = sum(device_seconds(e) for e in events) / steps
        row["device_share"] = row["device_s"] / wall
        row["kernels_per_step"] = len(kernels) / steps
        row["syncs_per_step"] = sum(e.count for e in events if e.key in SYNCS) / steps
        row["memcpy_per_step"] = sum(e.count for e in events if e.key == "cudaMemcpyAsync") / steps
        by_device = sorted(events, key=device_seconds, reverse=True)[:TOP]
        row["top_device"] = [{"op": e.key, "self_device_s": device_seconds(e) / steps, "calls": e.count / steps}
                             for e in by_device]
    by_cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP]
    row["top_cpu"] = [{"op": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6 / steps, "calls": e.count / steps}
                      for e in by_cpu]
    row["ops_per_step"] = sum(e.count for e in events) / steps
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--modes", default="nonprivate,bookkeeping,ghost")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model, _ = load_model(args.model)
    model.to(device).train()
    ids, mask = _batch(model.config.vocab_size, args.batch_size, args.seq_len, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    rows = []
    for mode in args.modes.split(","):
        rows.append(profile_mode(mode, model, ids, mask, device, args.steps, autocast))
        base = rows[0]["wall_s"]
        line = f"{mode:12s} wall {rows[-1]['wall_s']:.4f} s ({rows[-1]['wall_s'] / base:.2f}x)"
        if "device_s" in rows[-1]:
            line += (f"  device {rows[-1]['device_s']:.4f} s ({rows[-1]['device_share']:.0%} busy)  kernels "
                     f"{rows[-1]['kernels_per_step']:.0f}  syncs {rows[-1]['syncs_per_step']:.0f}")
        print(line, flush=True)
        top = rows[-1].get("top_device") or rows[-1]["top_cpu"]
        for entry in top[:8]:
            seconds = entry.get("self_device_s", entry.get("self_cpu_s"))
            print(f"    {seconds * 1e3:8.2f} ms  {entry['calls']:6.0f}x  {entry['op'][:80]}", flush=True)
    result = {"what": "torch.profiler per step, dptext bench-memory's steps", "device": args.device,
              "machine": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "model": args.model, "seq_len": args.seq_len,
              "batch_size": args.batch_size, "precision": "bf16 autocast" if device.type == "cuda" else "fp32",
              "steps": args.steps, "rows": rows}
    if args.out:
        atomic_write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
