"""Where the start-up probe's time goes on an FSDP2-sharded model: seconds and whole-model all-gathers per phase,
against a DP step's, on 2 gloo processes.

    python benchmarks/sharded_probe_cost.py [--model llama-medium|tinyllama-L4] [--batch 2 --length 32]
                                            [--out FILE.json]

The model is bench_fsdp.py's (a random Llama built in code, sharded per decoder layer and at the root); the engine
is DP-Adam book-keeping with its default proof (``engine.verify()``, every rank together). FSDP2's all-gathers are
counted by wrapping ``FSDPParamGroup.unshard`` (a unit's parameters, in whole-model units), only where the call
gathers: FSDP2 calls it again on a unit already gathered (the root, kept from its forward to its backward; a unit
prefetched by the one after it in the backward), which costs nothing. The engine's construction gathers every unit
once (its plan matches layers to rules on the whole weights); that is counted apart, not as the probe's. Each probe
phase is timed by wrapping the function that runs it. Then three DP steps on ``--batch`` × ``--length`` random
tokens per rank. Also the most parameters held gathered at once (in whole models) and the resident peak above the
process before the model, in the probe and in the steps. A pass's cost is its all-gathers and its compute; the
probe's batches are tiny, so at small training batches its time in DP steps follows the ratio of whole-model
passes.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

PHASES = (("sharded_probe", "gathered_parameters"), ("probe_checks", "engine_forward"),
          ("probe_checks", "reference_gradients"), ("probe_checks", "check_redrawn_examples"),
          ("probe_checks", "check_loss_independence"), ("verify", "check_whole_forward"),
          ("verify", "check_training_precision"))


def instrument(seconds: collections.Counter, gathers: collections.Counter, phase: list, held: dict) -> None:
    """Wrap each phase's function (its seconds) and FSDP2's unshard (its parameters, under the current phase) and
    reshard: ``held[phase]`` the most parameters gathered at once in it, sampled where a unit is given back."""
    import importlib

    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    for module_name, name in PHASES:
        module = importlib.import_module(f"dptext.privacy.proof.{module_name}")
        real = getattr(module, name, None)
        if real is None:
            continue

        def timed(*args, _real=real, _name=name, **kwargs):
            outer, phase[0], start = phase[0], _name, time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                seconds[_name] += time.perf_counter() - start
                phase[0] = outer

        setattr(module, name, functools.wraps(real)(timed))
    unshard = FSDPParamGroup.unshard

    reshard = FSDPParamGroup.reshard

    def size(group) -> int:
        return sum(param.sharded_param.numel() for param in group.fsdp_params)  # global sizes

    groups: list = []

    def counted(self, *args, **kwargs):
        if self._all_gather_result is None and not self.is_unsharded:  # else a no-op (FSDP2's own early returns)
            gathers[phase[0]] += size(self)
        if not any(self is each for each in groups):
            groups.append(self)
        return unshard(self, *args, **kwargs)

    def given_back(self, *args, **kwargs):
        # sampled where a unit is given back: what is gathered at that moment (a copy-served gather, which
        # ``proof.cached_gathers`` makes without FSDP2's unshard, is counted here too)
        now = sum(size(group) for group in groups if group.is_unsharded)
        key = phase[0] if phase[0] in ("DP step", "engine construction") else "probe"
        held[key] = max(held.get(key, 0), now)
        return reshard(self, *args, **kwargs)

    FSDPParamGroup.unshard, FSDPParamGroup.reshard = counted, given_back


def worker(model_name: str, batch: int, length: int, out: Path) -> None:
    import torch
    from bench_fsdp import PeakRss, build_model, rss_bytes

    from dptext.finetune.distributed import current, release
    from dptext.finetune.sharding import shard_model
    from dptext.privacy import PrivacyEngine

    seconds, gathers, phase, held = collections.Counter(), collections.Counter(), ["engine construction"], {"now": 0}
    instrument(seconds, gathers, phase, held)
    ctx = current("cpu")
    baseline = rss_bytes()  # torch, transformers and the process group, before any model exists
    ctx.sharded = True
    model = shard_model(tinyllama(model_name) if model_name.startswith("tinyllama-L") else build_model(model_name))
    whole = sum(param.numel() for param in model.parameters())
    engine = PrivacyEngine(model, torch.optim.Adam(model.parameters(), lr=1e-4), noise_multiplier=1.0,
                           max_grad_norm=1.0, expected_batch_size=batch * 2, dataset_size=10_000, distributed=ctx,
                           verify=True)  # (as dptext finetune: proven right after the engine is built)
    profile = cProfile.Profile() if os.environ.get("PROBE_PROFILE") and ctx.rank == 0 else None
    with PeakRss() as probe_rss:
        phase[0], start = "probe, other", time.perf_counter()
        if profile is not None:
            profile.enable()
        engine.verify()
        probe_seconds = time.perf_counter() - start
    if profile is not None:  # PROBE_PROFILE=FILE: rank 0's probe under cProfile (read it with pstats)
        profile.disable()
        profile.dump_stats(os.environ["PROBE_PROFILE"])
    ids = torch.randint(0, 1000, (batch, length), generator=torch.Generator().manual_seed(ctx.rank))
    steps = []
    with PeakRss() as step_rss:
        for _ in range(3):
            phase[0], start = "DP step", time.perf_counter()
            logits = model(input_ids=ids).logits
            flat = logits[:, :-1].reshape(-1, logits.shape[-1])
            losses = torch.nn.functional.cross_entropy(flat, ids[:, 1:].reshape(-1), reduction="none")
            engine.accumulate(losses.view(batch, -1).sum(1))
            engine.step()
            steps.append(time.perf_counter() - start)
    if ctx.rank == 0:
        step = sorted(steps)[1]
        probe_gathers = sum(count for name, count in gathers.items()
                            if name not in ("DP step", "engine construction")) / whole
        result = {"model": model_name, "parameters": whole, "batch_per_rank": batch, "length": length,
                  "probe_seconds": probe_seconds, "step_seconds": steps, "probe_in_dp_steps": probe_seconds / step,
                  "probe_whole_model_gathers": probe_gathers,
                  "dp_step_whole_model_gathers": gathers["DP step"] / whole / 3,
                  "engine_construction_whole_model_gathers": gathers["engine construction"] / whole,
                  "most_gathered_at_once_in_whole_models": {"probe": held.get("probe", 0) / whole,
                                                            "DP step": held.get("DP step", 0) / whole},
                  "peak_rss_mib_above_start": {"probe": (probe_rss.peak - baseline) / 2**20,
                                               "DP steps": (step_rss.peak - baseline) / 2**20},
                  "phases": {name: {"seconds": seconds[name], "whole_model_gathers": gathers[name] / whole}
                             for name in dict.fromkeys([*seconds, *gathers])
                             if name not in ("DP step", "engine construction")}}
        out.write_text(json.dumps(result, indent=1) + "\n")
    release()


def tinyllama(name: str):
    """``tinyllama-L<n>``: max_model.py's TinyLlama-shaped random model with n layers (4: 246M parameters)."""
    from max_model import build

    return build(int(name.removeprefix("tinyllama-L")), tiny=False, device="cpu")


def main() -> None:
    from two_ranks import free_port

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-medium")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("sharded_probe_cost.json"))
    args = parser.parse_args()
    env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, __file__, "--worker", args.model, str(args.batch), str(args.length), str(args.out)]
    procs = [subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    if any(proc.wait(timeout=1800) != 0 for proc in procs):
        raise SystemExit("a rank failed")
    print(args.out.read_text())


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
    else:
        main()
