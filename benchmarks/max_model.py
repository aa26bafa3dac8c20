"""The largest model that trains under a memory cap: non-private Adam against dptext DP-Adam with default settings.

    python benchmarks/max_model.py [--device cpu|cuda] [--cap-gb 20] [--layers 4,8,11,16,22]
                                   [--modes nonprivate,dp] [--tiny] [--batch 2] [--length 32] [--time-budget S]
                                   [--warm-up] [--out FILE.json]

The family is TinyLlama-1.1B's shape (hidden 2048, intermediate 5632, 32 heads with 8 key/value heads, a tied
32,000-token vocabulary) with L decoder layers and random weights built in code (no download): L = 4 is 246M
parameters, L = 22 is 1.1B. Every (mode, L) is one child process that builds the model, then
* ``nonprivate``: three Adam steps on a batch of 2 × 32 random tokens (the median is the step time);
* ``dp``: a book-keeping ``PrivacyEngine`` with its default settings, the start-up proof (``engine.verify()``,
  timed on its own), then three DP-Adam steps on the same batch;
* ``nonprivate-fsdp2`` / ``dp-fsdp2``: the same on 2 ranks (``torchrun``, gloo on the CPU), the model built whole
  on each rank and then ``fully_shard``-ed per decoder layer and at the root, as ``train.sharding: fsdp`` does; DP
  proves on the sharded model, every rank together (``proof.sharded_probe``), and reduces its clipped sums a
  chunk of layers at a time. The cap applies to the ranks together (one machine); peaks are per rank (the
  largest, each rank's in ``rank_peak_bytes``).
On CUDA the steps run under bf16 autocast and the proof is told so (``verify(training_dtype=torch.bfloat16)``, as
``dptext finetune`` does), so the proof timed is the one training relies on and no step proves again.
On the CPU the parent samples the child's resident memory and kills it above the cap (``fits: false``); the peak
is the kernel's high-water mark (``VmHWM``), reset between the proof and the steps so each has its own. On CUDA
the peak is ``torch.cuda.max_memory_allocated`` (reset the same way), and the cap is the device's memory: an
out-of-memory error is ``fits: false``. Layer counts are tried in increasing order, each for every mode that
still fits, so a run cut off by ``--time-budget`` has compared the modes at the same sizes.

Reported per row: parameters, fits, the step's peak (``peak_bytes``), the proof's peak and time
(``probe_peak_bytes``, ``probe_seconds``, ``probe_steps`` = its time in median DP steps), the median step time;
and per mode the largest L that fit. ``--tiny`` uses hidden 64 and a 512-token vocabulary (the rehearsal in
tests/test_max_model.py and the GPU check's ``--tiny``). ``--warm-up``: one plain forward and backward first, so
that one-time costs a first step would pay anyway (CUDA's set-up) are not counted as the proof's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

FULL = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 32000}
TINY = {"hidden_size": 64, "intermediate_size": 172, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 512}
MODES = ("nonprivate", "dp", "nonprivate-fsdp2", "dp-fsdp2")
RANKS = 2  # the FSDP2 modes: gloo processes on one machine (CPU) or one per GPU
BATCH, LENGTH, STEPS = 2, 32, 3  # the first step allocates Adam's state: the median is a steady one


def build(layers: int, tiny: bool, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=layers, tie_word_embeddings=True, **(TINY if tiny else FULL))
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config)


def peak_now(device: str) -> int:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def reset_peak(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return
    from dptext.allocator import release_freed_memory

    release_freed_memory()
    with open("/proc/self/clear_refs", "w") as clear:  # "5" resets VmHWM to the current resident set
        clear.write("5")


def child(mode: str, layers: int, tiny: bool, device: str, batch: int = BATCH, length: int = LENGTH, warm_up=False):
    """One trial in this process (with FSDP2: this rank's part of it); returns its numbers."""
    import torch

    from dptext.privacy import PrivacyEngine, causal_lm_loss

    ctx = None
    if mode.endswith("fsdp2"):
        from dptext.finetune.distributed import current

        ctx = current(device)
        ctx.sharded = True  # on CUDA each rank took cuda:LOCAL_RANK as its current device
    model = build(layers, tiny, device)  # whole on every rank, as dptext's loader does before fully_shard
    model.train()
    parameters = sum(p.numel() for p in model.parameters())
    local = batch // (ctx.world_size if ctx else 1)
    generator = torch.Generator().manual_seed(1 + (ctx.rank if ctx else 0))
    ids = torch.randint(1, model.config.vocab_size, (local, length), generator=generator).to(device)
    mask = torch.ones_like(ids)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))
    row = {"mode": mode, "layers": layers, "parameters": parameters}
    private = mode.startswith("dp")
    if ctx is not None:
        from dptext.finetune.sharding import shard_model

        shard_model(model)
    if warm_up:  # the process's one-time costs (CUDA's set-up, kernels loaded at first call) paid before timing
        with autocast:
            causal_lm_loss(model(input_ids=ids, attention_mask=mask).logits, ids, mask).sum().backward()
        model.zero_grad(set_to_none=True)
        row["warm_up"] = True
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    engine = None
    if private:
        engine = PrivacyEngine(model, optimizer, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=batch,
                               dataset_size=1000, distributed=ctx)
        prove(engine, row, device)  # under FSDP2 on the sharded model, every rank together (proof.sharded_probe)

    def step() -> float:
        start = time.perf_counter()
        with autocast:
            logits = model(input_ids=ids, attention_mask=mask).logits
        if engine is None:
            causal_lm_loss(logits, ids, mask).sum().backward()
            if ctx is not None:
                ctx.average_gradients(list(model.parameters()), local)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            engine.step(causal_lm_loss(logits, ids, mask))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    reset_peak(device)
    times = sorted(step() for _ in range(STEPS))
    row.update(fits=True, peak_bytes=peak_now(device), step_seconds=times[len(times) // 2])
    if ctx is not None:  # the largest over the ranks (per-rank peaks kept)
        ranks = ctx.gather(row)
        row = {**ranks[0], **{key: max(r.get(key, 0) for r in ranks) for key in
                              ("peak_bytes", "step_seconds", "probe_seconds", "probe_peak_bytes") if key in ranks[0]}}
        row["rank_peak_bytes"] = [r["peak_bytes"] for r in ranks]
    if "probe_seconds" in row:
        row["probe_steps"] = row["probe_seconds"] / row["step_seconds"]
        row["probe_to_step_peak"] = row["probe_peak_bytes"] / row["peak_bytes"]
    if ctx is not None:
        from dptext.finetune.distributed import release

        rank = ctx.rank
        release()
        return row if rank == 0 else {}
    return row


def prove(engine, row: dict, device: str) -> None:
    """The engine's start-up proof, timed, with its own peak memory."""
    import torch

    reset_peak(device)
    start = time.perf_counter()
    engine.verify(training_dtype=torch.bfloat16 if device.startswith("cuda") else None)
    row["probe_seconds"] = time.perf_counter() - start
    row["probe_peak_bytes"] = peak_now(device)


def rss_of(pid: int) -> int:
    """The resident memory of ``pid`` and all of its descendants (torchrun's ranks)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo.extend(children.get(current, []))
        try:
            with open(f"/proc/{current}/statm") as statm:
                total += int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
    return total


def trial(mode: str, layers: int, args) -> dict:
    """Run one (mode, L) in a child process; kill it above the cap (CPU)."""
    if mode.endswith("fsdp2") and args.device == "cuda" and (count := gpus()) < RANKS:
        return {"mode": mode, "layers": layers, "fits": None,
                "why": f"not run: FSDP2 takes one GPU per rank ({RANKS} ranks) and this machine has {count}"}
    command = [sys.executable, __file__, "--child", mode, "--layers", str(layers), "--device", args.device,
               "--batch", str(args.batch), "--length", str(args.length)]
    if mode.endswith("fsdp2"):
        command[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS)]
    command += (["--tiny"] if args.tiny else []) + (["--warm-up"] if args.warm_up else [])
    cap = args.cap_gb * 2**30
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    killed = False
    while proc.poll() is None:
        if args.device == "cpu" and rss_of(proc.pid) > cap:  # FSDP2: the ranks together (one machine)
            proc.send_signal(signal.SIGKILL)
            killed = True
        time.sleep(0.05)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if rows and proc.returncode == 0:
        row = {**rows[-1], "wall_seconds": wall}
        ranks = len(row.get("rank_peak_bytes", [0]))
        if args.device == "cpu" and ranks * max(row.get("peak_bytes", 0), row.get("probe_peak_bytes", 0)) > cap:
            # the sampler looks every 50 ms; the kernel's high-water mark is exact and has the last word
            row.update(fits=False, why="peak above the memory cap (between two samples)")
        return row
    why = "killed above the memory cap" if killed else failure(stderr)
    return {"mode": mode, "layers": layers, "fits": False, "why": why, "wall_seconds": wall}


def gpus() -> int:
    import torch

    return torch.cuda.device_count()


def failure(stderr: str) -> str:
    """The line that says why a child failed: its last error line (torchrun ends with a '====' banner)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip().strip("=")]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return ((errors or lines or ["no output"])[-1])[:300]


def machine(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name()
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    return f"{os.cpu_count()}-core CPU ({model})"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--cap-gb", type=float, default=20.0, help="CPU: kill a trial above this resident memory")
    parser.add_argument("--layers", default=None, help="comma-separated layer counts, tried in increasing order")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--batch", type=int, default=BATCH, help="examples per step (all ranks together)")
    parser.add_argument("--length", type=int, default=LENGTH, help="tokens per example")
    parser.add_argument("--time-budget", type=float, default=None, help="start no trial after this many seconds")
    parser.add_argument("--warm-up", action="store_true", help="a plain forward and backward before timing")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        row = child(args.child, int(args.layers), args.tiny, args.device, args.batch, args.length, args.warm_up)
        if row:
            print(json.dumps(row), flush=True)
        return {}
    default_layers = "1,2" if args.tiny else ("22,66,110,154,198" if args.device == "cuda" else "4,8,11,16,22")
    layer_counts = sorted(int(n) for n in (args.layers or default_layers).split(","))
    start, rows, largest = time.perf_counter(), [], {}
    fitting = args.modes.split(",")
    for layers in layer_counts:
        for mode in list(fitting):
            if args.time_budget is not None and time.perf_counter() - start > args.time_budget:
                rows.append({"mode": mode, "layers": layers, "fits": None, "why": "time budget spent"})
                fitting.remove(mode)
                continue
            row = trial(mode, layers, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if not row["fits"]:
                fitting.remove(mode)
                continue
            largest[mode] = {"layers": layers, "parameters": row["parameters"]}
    result = {"what": f"largest TinyLlama-shaped model (L layers, random weights) that trains {STEPS} steps of "
                      f"batch {args.batch} x {args.length} tokens: non-private Adam vs dptext DP-Adam book-keeping "
                      f"with its default settings (start-up proof on), in one process and on {RANKS} FSDP2 ranks",
              "device": args.device, "machine": machine(args.device), "cap_gb": args.cap_gb if args.device == "cpu"
              else None, "tiny": args.tiny, "rows": rows, "largest": largest}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
