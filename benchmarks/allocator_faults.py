"""Page faults and kernel time of one training step under glibc's allocator settings (issue 19).

    python benchmarks/allocator_faults.py                      # SmolLM2-135M, T = 64, B = 8, every setting
    python benchmarks/allocator_faults.py --model minilm-l6 --seq-len 32

For each allocator setting (freed memory kept in the heap, as ``dptext finetune`` runs, ``dptext.allocator``;
glibc's defaults; a fixed 128 KiB mmap threshold, as ``dptext.bench.MEMORY_ENV``) and each mode (non-private,
book-keeping), a fresh subprocess loads the model, takes one warm-up step and then ``--steps`` timed steps, and
reports per step: minor page faults, user and kernel CPU seconds (``getrusage``), the median wall time, and the
process's peak RSS. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_grid import MODELS  # noqa: E402  (the model -> head map of the grid; this script's folder is on the path)

from dptext.allocator import keep_freed_memory  # noqa: E402
from dptext.bench import MEMORY_ENV  # noqa: E402

SETTINGS = {"kept (as dptext finetune)": {}, "glibc defaults": {"DPTEXT_ALLOCATOR": "default"},
            "threshold 128 KiB": MEMORY_ENV}
MODES = ("nonprivate", "bookkeeping")


def measure(mode: str, model_name: str, seq_len: int, batch_size: int, steps: int) -> dict:
    """In this process: one warm-up step, then ``steps`` timed steps with their rusage deltas."""
    import torch

    from dptext.bench_step import _batch, _make_step
    from dptext.models import load_model

    torch.manual_seed(0)
    head = MODELS[model_name][0]
    model, _ = load_model(model_name, head=head, num_labels=2 if head == "sequence_classification" else None)
    model.train()
    ids, mask = _batch(model.config.vocab_size, batch_size, seq_len, torch.device("cpu"))
    step, close = _make_step(mode, model, batch_size)
    step(ids, mask)
    before, times = resource.getrusage(resource.RUSAGE_SELF), []
    for _ in range(steps):
        start = time.perf_counter()
        step(ids, mask)
        times.append(time.perf_counter() - start)
    after = resource.getrusage(resource.RUSAGE_SELF)
    close()
    return {"mode": mode, "minor_faults_per_step": (after.ru_minflt - before.ru_minflt) / steps,
            "user_s_per_step": (after.ru_utime - before.ru_utime) / steps,
            "kernel_s_per_step": (after.ru_stime - before.ru_stime) / steps,
            "step_s_median": statistics.median(times), "peak_rss_mb": after.ru_maxrss / 1024}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--inside", help=argparse.SUPPRESS)  # the mode, when this is the measuring subprocess
    args = parser.parse_args(argv)
    if args.inside:
        keep_freed_memory()  # as the dptext entry point does, unless the setting's environment says otherwise
        print(json.dumps(measure(args.inside, args.model, args.seq_len, args.batch_size, args.steps)))
        return
    rows = []
    for setting, env in SETTINGS.items():
        for mode in MODES:
            command = [sys.executable, __file__, "--model", args.model, "--seq-len", str(args.seq_len),
                       "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--inside", mode]
            done = subprocess.run(command, capture_output=True, text=True, check=True,
                                  env={**os.environ, "PYTHONWARNINGS": "ignore", **env})
            rows.append({"allocator": setting, **json.loads(done.stdout.strip().splitlines()[-1])})
            print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
