"""Peak memory and step time of book-keeping against the hybrid (ghost treatment) at long T (issue 42).

    python benchmarks/long_sequences.py [--out benchmarks/results/long_sequences_cpu.json]

For each model (random weights built in code: a 2-layer Llama of width 256 with tied embeddings at T = 4096, a
2-layer GPT-2 of width 256 at T = 2048; B = 1, fp32) every mode runs in its own subprocess, side by side in one
invocation: non-private SGD, book-keeping (the default), the hybrid (``max_stored_bytes=0``: every eligible layer
under the ghost treatment, clipping/long_sequences.py) and ghost clipping. Peak: the process's peak resident set
(VmHWM, reset after a first step, with glibc returning every freed block over 128 KiB to the OS, as ``dptext
bench-memory`` reads it on CPU) minus the resident set before the second step, i.e. what a step itself needs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from max_model import peak_now, reset_peak  # noqa: E402

MODELS = {"llama-2x256": 4096, "gpt2-2x256": 2048}
MODES = ("nonprivate", "bookkeeping", "hybrid", "ghost")


def build(name: str, length: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if name.startswith("llama"):
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=688,
                                            num_attention_heads=4, num_key_value_heads=4, vocab_size=8000,
                                            tie_word_embeddings=True, max_position_embeddings=length))
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=256, n_head=4, n_positions=length, vocab_size=8000))


def measure(name: str, mode: str, length: int, batch: int) -> dict:
    """One mode in this process: a warm-up step, then one measured step (peak and time)."""
    import torch

    from dptext.privacy import PrivacyEngine, per_example_loss

    model = build(name, length).train()
    ids = torch.randint(5, 8000, (batch, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    engine = None
    if mode != "nonprivate":
        extra = {"max_stored_bytes": 0, "sequence_length": length} if mode == "hybrid" else {}
        engine = PrivacyEngine(model, optimizer, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=batch,
                               dataset_size=100, clipping_mode="ghost" if mode == "ghost" else "bookkeeping",
                               verify=False, **extra)

    def step() -> None:
        loss = per_example_loss(model(input_ids=ids, attention_mask=mask, use_cache=False).logits, ids, mask,
                                shift=True)
        if engine is None:
            loss.mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            engine.step(loss)

    step()
    reset_peak("cpu")
    base = peak_now("cpu")
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    ghost = len(engine.ghost_modules) if engine is not None and hasattr(engine, "ghost_modules") else 0
    return {"model": name, "mode": mode, "T": length, "B": batch, "step_peak_mb": (peak_now("cpu") - base) / 2**20,
            "step_s": seconds, "ghost_treated_layers": ghost}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # name,mode,length: run one mode here
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.one:
        name, mode, length = args.one.split(",")
        print(json.dumps(measure(name, mode, int(length), args.batch)), flush=True)
        return {}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    rows = []
    for name, length in MODELS.items():
        for mode in MODES:
            done = subprocess.run([sys.executable, __file__, "--one", f"{name},{mode},{length}", "--batch",
                                   str(args.batch)], capture_output=True, text=True, env=env)
            lines = done.stdout.strip().splitlines()
            row = json.loads(lines[-1]) if done.returncode == 0 and lines else {
                "model": name, "mode": mode, "status": (done.stderr.strip().splitlines() or ["failed"])[-1]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    result = {"machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, one thread, torch "
              f"{__import__('torch').__version__}", "dtype": "float32", "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
