"""Step time and memory of the three noise mechanisms side by side: dp_sgd, banded_mf and blt (SPEC §12).

    python benchmarks/bench_correlated_noise.py [--model llama-small] [--out benchmarks/results/FILE.json]

Each mechanism runs in its own process (so peak memories do not mix), in rounds that alternate the mechanisms
(on a shared machine, passing load spreads over all three). A process builds the random model in code, the
book-keeping engine of its mechanism over every parameter (start-up probe off: it is the same for all three and
not a step cost), and trains ``--warmup`` + ``--steps`` steps on one fixed batch with ``--threads`` torch threads.
It reports the median step time (wall, and CPU seconds of the process: the fairer number on a shared machine),
the median CPU seconds spent drawing (and, for MF, filtering) the noise, the peak resident memory above the
process just before the first step, and the bytes of noise state the mechanism keeps (b − 1 or d fp32
model-sized buffers).
The strategies are optimised, as a run would, for ``--plan-steps`` steps over ``--bins`` cyclic bins
(k = ⌈S/P⌉ participations), and their start-up time is reported too.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))

from bench_fsdp import MODELS, PeakRss, build_model, rss_bytes  # noqa: E402

MECHANISMS = ("dp_sgd", "banded_mf", "blt")


def make_engine(mechanism: str, model, args) -> tuple[object, float]:
    """The mechanism's engine over every parameter and the seconds its strategy took to optimise."""
    from dptext.accounting.banded_mf import Participation
    from dptext.accounting.blt_strategy import optimize_blt
    from dptext.accounting.mf_strategy import optimize_banded
    from dptext.privacy import BandedMFEngine, BLTEngine, PrivacyEngine

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    size = args.batch * args.bins
    common = dict(noise_multiplier=1.0, max_grad_norm=1.0, dataset_size=size, seed=0, verify=False)
    if mechanism == "dp_sgd":
        return PrivacyEngine(model, optimizer, sample_rate=1 / args.bins, **common), 0.0
    schema = Participation(math.ceil(args.plan_steps / args.bins), args.bins)
    started = time.perf_counter()
    if mechanism == "banded_mf":
        coefficients = list(optimize_banded(args.plan_steps, args.bands, schema).coefficients)
        seconds = time.perf_counter() - started
        return BandedMFEngine(model, optimizer, steps=args.plan_steps, bins=args.bins, coefficients=coefficients,
                              **common), seconds
    blt = optimize_blt(args.plan_steps, args.buffers, schema).blt
    seconds = time.perf_counter() - started
    return BLTEngine(model, optimizer, steps=args.plan_steps, bins=args.bins, blt=blt, **common), seconds


def noise_state_bytes(engine) -> int:
    """Bytes of the noise filter's buffers (0 for DP-SGD): what correlated noise adds to a step's memory."""
    noise = engine.dp_optimizer.noise
    kept = getattr(noise, "history", None) or getattr(noise, "buffers", None) or []
    return sum(t.numel() * t.element_size() for per_param in kept for t in per_param)


def measure_one(mechanism: str, args) -> dict:
    """One mechanism in this process (``--one``): step times, noise times, peak memory, noise-state bytes."""
    from dptext.privacy import per_example_loss

    torch.set_num_threads(args.threads)  # CPU seconds per thread are what a shared machine measures fairly
    model = build_model(args.model)
    engine, optimise_seconds = make_engine(mechanism, model, args)
    noise, drawing = engine.dp_optimizer.noise, []
    draw = noise.normals

    def timed_draw(*a, **k):
        start = time.process_time()
        drawn = draw(*a, **k)
        drawing.append(time.process_time() - start)
        return drawn

    noise.normals = timed_draw
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, model.config.vocab_size, (args.batch, args.seq_len), generator=generator)
    before, steps, cpu_steps, noise_steps = rss_bytes(), [], [], []
    with PeakRss() as peak:
        for index in range(args.warmup + args.steps):
            drawing.clear()
            start, cpu_start = time.perf_counter(), time.process_time()
            logits = model(input_ids=ids, use_cache=False).logits
            engine.step(per_example_loss(logits, ids, torch.ones_like(ids), shift=True))
            if index >= args.warmup:
                steps.append(time.perf_counter() - start)
                cpu_steps.append(time.process_time() - cpu_start)
                noise_steps.append(sum(drawing))
    return {"mechanism": mechanism, "step_s": statistics.median(steps), "step_cpu_s": statistics.median(cpu_steps),
            "noise_cpu_s": statistics.median(noise_steps),
            "peak_above_start_mib": (peak.peak - before) / 2 ** 20,
            "noise_state_mib": noise_state_bytes(engine) / 2 ** 20, "strategy_optimise_s": optimise_seconds}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-small", choices=sorted(m for m in MODELS if MODELS[m]))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (at least bands − 1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plan-steps", type=int, default=2000)
    parser.add_argument("--bins", type=int, default=500)
    parser.add_argument("--bands", type=int, default=8)
    parser.add_argument("--buffers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--machine", default="")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", choices=MECHANISMS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.warmup = max(args.warmup, args.bands - 1)  # banded MF's ring is full (b − 1 buffers) before timing starts
    if args.one:
        print(json.dumps(measure_one(args.one, args)))
        return {}
    runs: dict[str, list[dict]] = {m: [] for m in MECHANISMS}
    for _ in range(args.rounds):
        for mechanism in MECHANISMS:
            child = [sys.executable, __file__, "--one", mechanism, "--model", args.model]
            for name in ("batch", "seq_len", "steps", "warmup", "plan_steps", "bins", "bands", "buffers", "threads"):
                child += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
            done = subprocess.run(child, capture_output=True, text=True, check=True)
            runs[mechanism].append(json.loads(done.stdout.strip().splitlines()[-1]))
    results = [summarise(runs[m]) for m in MECHANISMS]
    baseline = results[0]
    for result in results:
        result["cpu_time_vs_dp_sgd"] = result["step_cpu_s"] / baseline["step_cpu_s"]
    parameters = sum(p.numel() for p in build_model(args.model).parameters())
    report = {"what": "dp_sgd vs banded_mf vs blt: median step time (wall and CPU seconds of the process), CPU "
                      "seconds drawing and filtering the noise, peak RSS above the start of the steps, "
                      "noise-state buffers (benchmarks/bench_correlated_noise.py)",
              "model": args.model, "parameters": parameters, "fp32_model_mib": parameters * 4 / 2 ** 20,
              "batch": args.batch, "seq_len": args.seq_len, "warmup_steps": args.warmup, "timed_steps": args.steps,
              "clipping": "bookkeeping, all_layer",
              "plan": {"steps": args.plan_steps, "bins": args.bins, "bands": args.bands, "buffers": args.buffers},
              "torch_threads": args.threads,
              "machine": args.machine or machine(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "rounds": args.rounds, "results": results}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def summarise(runs: list[dict]) -> dict:
    """Medians over the rounds (the state size is the same in every round)."""
    keys = ("step_s", "step_cpu_s", "noise_cpu_s", "peak_above_start_mib", "strategy_optimise_s")
    return {"mechanism": runs[0]["mechanism"], **{k: statistics.median(r[k] for r in runs) for k in keys},
            "noise_state_mib": runs[0]["noise_state_mib"]}


def machine() -> str:
    import os
    import platform

    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, {torch.get_num_threads()} " \
           "torch threads"


if __name__ == "__main__":
    main()
