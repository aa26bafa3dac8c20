"""Cost of the fail-closed checks on SmolLM2-135M: the start-up probe, the per-step invariant and ghost mode's
per-step outside-read check.

    python benchmarks/bench_engine_checks.py [--batch 8 --length 64 --steps 3]

The probe runs once before training (two synthetic batches, fp64, brute-force per-example autograd); the
invariant runs on every micro-batch's clipped sums; the outside-read check (ghost mode) walks the autograd graph
once per micro-batch before the first backward pass. All are timed in this process next to DP steps of the same
batch, so the ratios hold even on a shared machine (the load average is printed). The C allocator is set as the
``dptext`` entry point sets it (``dptext.allocator``), so the steps cost what they cost in ``dptext finetune``.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from dptext.models import load_model
from dptext.privacy import PrivacyEngine, causal_lm_loss
from dptext.privacy.clipping.sums import sums as clipping


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    model, _ = load_model("smollm2-135m", head="causal_lm")
    model.train()
    print(f"load average at the start: {os.getloadavg()[0]:.1f}", flush=True)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    engine = PrivacyEngine(model, optimizer, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=args.batch,
                           dataset_size=1000)
    start = time.perf_counter()
    report = engine.verify()
    probe_s = time.perf_counter() - start
    ids = torch.randint(1, model.config.vocab_size, (args.batch, args.length),
                        generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    step_s, check_s = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        logits = model(input_ids=ids, attention_mask=mask).logits
        engine.accumulate(causal_lm_loss(logits, ids, mask))
        sums = engine.clipped_grads()
        t0 = time.perf_counter()
        clipping.check_clipped_sums(sums, torch.ones(args.batch), args.batch, 1.0, "all_layer", len(engine.params))
        check_s.append(time.perf_counter() - t0)
        engine.step()
        step_s.append(time.perf_counter() - start)
    step = sorted(step_s)[len(step_s) // 2]
    check = sorted(check_s)[len(check_s) // 2]
    engine.detach()
    ghost = PrivacyEngine(model, optimizer, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=args.batch,
                          dataset_size=1000, clipping_mode="ghost")
    start = time.perf_counter()
    logits = model(input_ids=ids, attention_mask=mask).logits
    loss = causal_lm_loss(logits, ids, mask)
    t0 = time.perf_counter()
    assert ghost.outside_reads.outside_read(loss) is None
    walk_s = time.perf_counter() - t0
    ghost.step(loss)
    ghost_s = time.perf_counter() - start
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.1f} at the end; SmolLM2-135M fp32, B={args.batch}, T={args.length}")
    print(f"start-up probe (bookkeeping): {probe_s:.1f} s ({len(report.rows)} layers, "
          f"{sum(r.status == 'exact' for r in report.rows.values())} exact) = {probe_s / step:.2f} DP steps")
    print(f"DP step (bookkeeping): {step:.2f} s; per-step invariant: {check * 1000:.1f} ms "
          f"({100 * check / step:.2f}% of the step)")
    print(f"DP step (ghost): {ghost_s:.2f} s; outside-read check (graph walk): {walk_s * 1000:.1f} ms "
          f"({100 * walk_s / ghost_s:.2f}% of the step)")


if __name__ == "__main__":
    from dptext.allocator import keep_freed_memory

    keep_freed_memory()  # as `dptext finetune` runs (its entry point sets it): steps without page-fault storms
    main()
