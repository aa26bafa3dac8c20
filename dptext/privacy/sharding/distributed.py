"""DP training on ``torch.distributed``: one process per device, launched with ``torchrun``.

Launch (CPU: gloo; GPU: NCCL, one process per GPU)::

    torchrun --standalone --nproc_per_node 2 -m dptext finetune RECIPE.yaml [key=value ...] [--out DIR]

Without torchrun (no ``WORLD_SIZE`` > 1 in the environment) everything runs in one process exactly as before.

How the privacy of the distributed step is kept equal to the single-process one (SPEC §1, §4):

* **Shards fixed by index.** Example i lives on rank ``i mod N`` (independent of the data) and is
  Poisson-sampled there with the global rate q by that rank's own generator. The union of the ranks' samples
  is a Poisson sample of the whole set with rate q, so the ledger accounts q = B/n with B the expected global
  batch. Adding or removing one example changes only its own rank's batch. Each rank's sampler draws from its
  own child of the random root (``dptext.privacy.noise.randomness``, spawn key (sampler, rank)), never an offset seed
  and never the noise's stream.
* **Clipping is local.** Each rank clips its own examples with the engine's clipping mode (or, for eDP-SGD,
  its own micro-batches); the clipped sums are all-reduced (summed) in one flat buffer.
* **Noise is added once, on rank 0**, before the all-reduce: N(0, σ²C²) per coordinate, exactly the σ the
  accountant assumed, from rank 0's noise generator (the same one a single-process run with the same root
  uses). We do not split it into N shares N(0, σ²C²/N): a split needs every rank's noise to be honest and
  independent (a rank with a broken or shared seed, or a rank that sees its own pre-aggregation share, would
  leave the sum under-noised), while one draw on one rank makes the guarantee depend on one generator and is
  testable against the single-process run. The cost is one rank drawing the noise of the whole model, which
  a single-process run pays anyway.
* **Only rank 0 writes** the run directory (checkpoints, metrics, ledger, model, result). Other ranks read it
  (resume) and drop their writes; checkpoints hold every rank's sampler and RNG state, gathered to rank 0.

This module holds what the mechanism needs of the processes (rank, world size, the shard each rank samples,
the all-reduce of clipped sums, rank 0's broadcast); the process group itself (set-up from torchrun's
environment, who writes, gathered checkpoints, the follower run) belongs to the run, in
``dptext.finetune.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class DistributedContext:
    """Rank and world size of this process; a world of 1 is the ordinary single-process run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    sharded: bool = False  # FSDP2 (train.sharding=fsdp): each rank owns rows of every parameter (sharding/sharded.py)

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def shard(self, dataset_size: int) -> list[int]:
        """The example indices this rank owns: i with i mod N = rank (fixed by index, not by data)."""
        return list(range(self.rank, dataset_size, self.world_size))

    # ------------------------------------------------------------------ collectives
    def all_reduce_sum(self, tensors: dict[Any, Any]) -> dict[Any, Any]:
        """Sum each tensor over the ranks (one flat buffer, one all-reduce); same keys, new tensors."""
        if not self.active or not tensors:
            return tensors
        keys = list(tensors)
        flat = torch.cat([tensors[k].reshape(-1).float() for k in keys])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        out, start = {}, 0
        for k in keys:
            n = tensors[k].numel()
            out[k] = flat[start:start + n].view_as(tensors[k]).to(tensors[k].dtype)
            start += n
        return out

    def any_rank(self, flag: bool, device: torch.device) -> bool:
        """Whether ``flag`` is true on any rank (every rank calls it: one scalar all-reduce on ``device``)."""
        if not self.active:
            return flag
        box = torch.tensor([1.0 if flag else 0.0], device=device)
        dist.all_reduce(box, op=dist.ReduceOp.SUM)
        return bool(box.item() > 0)

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if not self.active:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
