"""Peak memory and step time of book-keeping against the hybrid (ghost treatment) at long T (issue 42).

    python benchmarks/long_sequences.py [--out benchmarks/results/long_sequences_cpu.json]

For each model (random weights built in code: a 2-layer Llama of width 256 with tied embeddings at T = 4096, a
2-layer GPT-2 of width 256 at T = 2048, and a 6-layer Llama of width 256 with a 1000-token vocabulary at T = 4096,
where the decoder layers rather than the logits hold most of the memory; B = 1, fp32) every mode runs in its own
subprocess, side by side in one invocation: non-private SGD, book-keeping (the default), the hybrid
(``max_stored_bytes=0``: every eligible layer under the ghost treatment, clipping/long_sequences.py) and ghost
clipping. Peak: the process's peak resident set (VmHWM, reset after a first step, with glibc returning every freed
block over 128 KiB to the OS, as ``dptext bench-memory`` reads it on CPU) minus the resident set before the second
step, i.e. what a step itself needs. ``--models`` runs some of them (the JSON then holds only those);
``--phases MODEL`` reads book-keeping's peak after each phase of one step (forward, backward, norms and sums).
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

MODELS = {"llama-2x256": 4096, "gpt2-2x256": 2048, "llama-6x256-v1000": 4096}  # the last: blocks dominate
MODES = ("nonprivate", "bookkeeping", "hybrid", "ghost")


def build(name: str, length: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if name.startswith("llama"):
        layers, vocab = (6, 1000) if name.endswith("v1000") else (2, 8000)
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, hidden_size=256, intermediate_size=688,
                                            num_attention_heads=4, num_key_value_heads=4, vocab_size=vocab,
                                            tie_word_embeddings=True, max_position_embeddings=length))
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=256, n_head=4, n_positions=length, vocab_size=8000))


def measure(name: str, mode: str, length: int, batch: int) -> dict:
    """One mode in this process: a warm-up step, then one measured step (peak and time)."""
    import torch

    from dptext.privacy import PrivacyEngine, per_example_loss

    model = build(name, length).train()
    ids = torch.randint(5, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
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


def phases(name: str, length: int, batch: int) -> dict:
    """Book-keeping's peak at the end of each phase of one step (after a warm-up step): forward, backward pass,
    norms and clipped sums. Run it with MALLOC_MMAP_THRESHOLD_=131072, as the side-by-side run does."""
    import torch

    import dptext.privacy.engine as engine_module
    from dptext.privacy import PrivacyEngine, per_example_loss

    model = build(name, length).train()
    ids = torch.randint(5, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=1e-6), noise_multiplier=1.0,
                           max_grad_norm=1.0, expected_batch_size=batch, dataset_size=100, verify=False)
    marks: dict = {}
    backward, clip = engine_module.backward_once, engine_module.clip_recorded

    def timed_backward(loss):
        marks["forward"] = peak_now("cpu")
        backward(loss)
        marks["backward"] = peak_now("cpu")

    def timed_clip(*args, **kwargs):
        norms = clip(*args, **kwargs)
        marks["norms_and_sums"] = peak_now("cpu")
        return norms

    engine_module.backward_once, engine_module.clip_recorded = timed_backward, timed_clip
    for warm in (True, False):
        if not warm:
            reset_peak("cpu")
            base = peak_now("cpu")
        engine.step(per_example_loss(model(input_ids=ids, attention_mask=mask, use_cache=False).logits, ids, mask,
                                     shift=True))
    marks["step"] = peak_now("cpu")
    return {"model": name, "T": length, "B": batch, **{f"peak_mb_after_{k}": (v - base) / 2**20
                                                        for k, v in marks.items()}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # name,mode,length: run one mode here
    parser.add_argument("--phases", help="one model: book-keeping's peak after each phase of a step, in this process")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, of " + ", ".join(MODELS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.phases:
        print(json.dumps(phases(args.phases, MODELS[args.phases], args.batch)), flush=True)
        return {}
    if args.one:
        name, mode, length = args.one.split(",")
        print(json.dumps(measure(name, mode, int(length), args.batch)), flush=True)
        return {}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    rows = []
    for name in args.models.split(","):
        length = MODELS[name]
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
