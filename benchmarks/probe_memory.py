"""Peak memory and time of the start-up verification probe (``engine.verify()``) on a random Llama built in code.

    python benchmarks/probe_memory.py [--model llama-medium|llama-small|smollm2-135m] [--out FILE.json]

Builds the model (tied embeddings), a book-keeping ``PrivacyEngine`` over every parameter, then runs the probe
(fp64 reference, the two default probe shapes) once while sampling the resident set size every 5 ms. It prints
the peak above the process's memory just before the probe (the fp64 copy of the model, the reference, the
engine's sums) in units of the model's fp32 size, so models of any size compare. One process, CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))

from bench_fsdp import MODELS, PeakRss, build_model, rss_bytes  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-medium", choices=sorted(MODELS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from dptext.allocator import release_freed_memory
    from dptext.privacy import PrivacyEngine

    model = build_model(args.model)
    parameters = sum(p.numel() for p in model.parameters())
    engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                           max_grad_norm=1.0, expected_batch_size=8, dataset_size=1000)
    release_freed_memory()
    before = rss_bytes()
    start = time.perf_counter()
    with PeakRss() as peak:
        engine.verify()
    seconds = time.perf_counter() - start
    fp32_bytes = parameters * 4
    result = {"model": args.model, "parameters": parameters, "peak_above_before_mib": (peak.peak - before) / 2**20,
              "peak_in_fp32_models": (peak.peak - before) / fp32_bytes, "seconds": seconds,
              "torch": torch.__version__}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
