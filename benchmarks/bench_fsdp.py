"""Per-rank memory and step time of DP training sharded with FSDP2 against non-private FSDP2 and unsharded DP.

    python benchmarks/bench_fsdp.py [--model llama-small|llama-medium|smollm2-135m] [--batch 8 --length 64]
                                    [--steps 3] [--nproc 2] [--out benchmarks/results/bench_fsdp_cpu.json]

One invocation launches three ``torchrun`` jobs of N processes one after the other, each Adam steps on the same
random tokens (expected batch ``--batch`` split over the ranks, sequences of ``--length`` tokens): non-private
FSDP2 (``fully_shard`` per decoder layer and at the root), DP-Adam book-keeping sharded the same way (σ = 1, C = 1,
with the default start-up probe on the sharded model, every rank together, as ``dptext finetune`` runs it), and DP
with every rank holding the whole model (``train.sharding: none``). Per rank it measures the bytes of parameters +
gradients + Adam state held after a step (local shards); the peak resident memory above the process's memory before
the model was built (libraries, process group) while loading, while probing and during the timed steps; the probe's
time and the median step time. ``ratios_dp_fsdp_over_nonprivate_fsdp`` is the issue's measure (≤ 1.05 per rank).
On CPU the processes share the cores (gloo), so the time ratios say what sharding's collectives cost there, not
what a GPU gets; on GPUs run it with ``--device cuda`` (one process per GPU, NCCL; the step peak is then
torch.cuda.max_memory_allocated).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

JOBS = (("nonprivate_fsdp", "nonprivate", "fsdp"), ("dp_fsdp", "dp", "fsdp"), ("dp_unsharded", "dp", "none"))
MODELS = {"llama-small": (256, 768, 4, 8192), "llama-medium": (512, 1536, 8, 16384), "smollm2-135m": None}


def build_model(name: str):
    if name == "smollm2-135m":
        from dptext.models import load_model

        return load_model(name, head="causal_lm")[0]
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, intermediate, layers, vocab = MODELS[name]  # random Llamas built in code (~9M, ~36M parameters)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The largest resident set size of this process (or another of its sizes, ``sample``), sampled every 5 ms
    while active."""

    def __init__(self, sample=rss_bytes):
        self.sample = sample
        self.peak, self._stop = sample(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.sample())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def worker(args) -> None:
    """One rank of one job: the default start-up probe (DP only: by the engine on the model as it trains, sharded
    under FSDP2, as ``dptext finetune`` runs it), then a few steps on random tokens (public, synthetic); this
    rank's numbers."""
    from dptext.finetune.distributed import current, release
    from dptext.finetune.sharding import held_bytes, shard_model
    from dptext.privacy import PrivacyEngine, causal_lm_loss

    ctx = current(args.device)
    baseline = rss_bytes()  # torch, transformers and the process group, before any model exists
    ctx.sharded = args.sharding == "fsdp"
    private = args.mode == "dp"
    device = torch.device("cuda", ctx.local_rank) if args.device == "cuda" else torch.device("cpu")
    with PeakRss() as loading:
        model = build_model(args.model).to(device)
        model.train()
        ctx.broadcast_parameters(model)
    probe_peak, probe_seconds = 0, 0.0
    if ctx.sharded:
        shard_model(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    engine = None
    if private:  # the default proof, by the engine itself: sharded, every rank together, under FSDP2
        engine = PrivacyEngine(model, optimizer, noise_multiplier=1.0, max_grad_norm=1.0,
                               expected_batch_size=args.batch, dataset_size=1000, distributed=ctx, seed=0,
                               verify=False)
        with PeakRss() as proving:
            start = time.perf_counter()
            engine.verify()
            probe_seconds = time.perf_counter() - start
        probe_peak = proving.peak - baseline
    local = args.batch // ctx.world_size
    generator = torch.Generator().manual_seed(ctx.rank)
    ids = torch.randint(1, model.config.vocab_size, (local, args.length), generator=generator).to(device)
    mask = torch.ones_like(ids)

    def step() -> float:
        start = time.perf_counter()
        logits = model(input_ids=ids, attention_mask=mask).logits
        if private:
            engine.accumulate(causal_lm_loss(logits, ids, mask))
            engine.step()
        else:
            causal_lm_loss(logits, ids, mask).sum().backward()
            ctx.average_gradients(list(model.parameters()), local)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    step()  # warm-up: optimizer state allocated, first-call costs paid
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with PeakRss() as rss:
        times = sorted(step() for _ in range(args.steps))
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else rss.peak - baseline
    held = held_bytes(model, optimizer)
    numbers = ctx.gather({"rank": ctx.rank, "state_bytes": held, "peak_bytes": peak,
                          "load_peak_bytes": loading.peak - baseline, "probe_peak_bytes": probe_peak,
                          "probe_seconds": probe_seconds, "step_seconds": times[len(times) // 2]})
    if ctx.rank == 0:
        Path(args.worker_out).write_text(json.dumps(numbers))
    release()


def launch(args, mode: str, sharding: str, out: Path) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
               __file__, "--worker-out", str(out), "--mode", mode, "--sharding", sharding, "--model", args.model,
               "--batch", str(args.batch), "--length", str(args.length), "--steps", str(args.steps),
               "--device", args.device]
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.read_text())


def summary(ranks: list[dict]) -> dict:
    """Per rank, the largest over the ranks; ``run_peak``: the whole run's (loading, the probe, the steps)."""
    most = {key: max(r[key] for r in ranks) for key in ranks[0] if key != "rank"}
    return {"state_mib_per_rank": most["state_bytes"] / 2**20, "step_peak_mib_per_rank": most["peak_bytes"] / 2**20,
            "probe_peak_mib_per_rank": most["probe_peak_bytes"] / 2**20,
            "run_peak_mib_per_rank": max(most["peak_bytes"], most["probe_peak_bytes"], most["load_peak_bytes"]) / 2**20,
            "probe_seconds": most["probe_seconds"], "step_seconds": most["step_seconds"], "ranks": ranks}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=MODELS, default="llama-small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_fsdp_cpu.json"))
    parser.add_argument("--worker-out")
    parser.add_argument("--sharding", choices=("none", "fsdp"))
    parser.add_argument("--mode", choices=("dp", "nonprivate"))
    args = parser.parse_args()
    if args.worker_out:
        worker(args)
        return
    load = os.getloadavg()[0]
    scratch = Path(args.out).with_suffix(".part")
    jobs = {name: summary(launch(args, mode, sharding, scratch)) for name, mode, sharding in JOBS}
    scratch.unlink()
    keys = ("state_mib_per_rank", "step_peak_mib_per_rank", "run_peak_mib_per_rank", "step_seconds")
    result = {"model": args.model, "batch": args.batch, "length": args.length, "steps": args.steps,
              "processes": args.nproc, "device": args.device, "clipping_mode": "bookkeeping", "optimizer": "adam",
              "load_average_at_start": load, "cpu_count": os.cpu_count(), "torch": torch.__version__, **jobs,
              "ratios_dp_fsdp_over_nonprivate_fsdp": {key: jobs["dp_fsdp"][key] / jobs["nonprivate_fsdp"][key]
                                                      for key in keys},
              "ratios_dp_fsdp_over_dp_unsharded": {key: jobs["dp_fsdp"][key] / jobs["dp_unsharded"][key]
                                                   for key in keys},
              "probe_seconds_in_dp_fsdp_steps": jobs["dp_fsdp"]["probe_seconds"] / jobs["dp_fsdp"]["step_seconds"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in {name for name, _, _ in JOBS}}, indent=2))


if __name__ == "__main__":
    main()
