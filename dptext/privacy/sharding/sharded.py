"""The DP step when the model is sharded with FSDP2 (``train.sharding: fsdp``; docs/sharding.md).

What changes against ``dptext.privacy.sharding.distributed`` (every rank holds the whole model):

* **Clipping is unchanged.** FSDP2 all-gathers each block's weights before its forward and backward, so the
  engine's hooks see the full activations and output gradients of the local examples; the per-example norms of
  every layer (tied weights included) are computed on each rank for its own examples exactly as in one process.
* **Reduce-scatter per micro-batch, a chunk of layers at a time.** Once the norms are known, book-keeping forms the
  clipped sums (c ⊙ g)ᵀa a chunk of whole layers at a time and reduce-scatters each chunk at once
  (``row_reduce``): each rank keeps only the sum over the ranks of the rows it owns (FSDP2's Shard(0) layout), so
  no full-size clipped sum outlives its chunk. per_sample reduces its sums the same way; ghost lets FSDP2's own
  reduce-scatter do it in its second backward pass (below). The bound ‖Σ‖ ≤ units·C needs every rank's rows: it
  is checked at the step over one all-reduce, and every rank reaches the same verdict.
* **Noise once per coordinate, each rank noising its own shard.** The noise of coordinate j of parameter P at
  step t is drawn from a generator seeded by (noise key, t, P's name, the block of 2¹⁶ coordinates holding j) and
  never from anything a rank chooses, so a coordinate's value is the same whichever rank owns it and however many
  ranks there are: the shards partition the coordinates, every coordinate is drawn exactly once, and the noise
  of a sharded run equals the noise of one process with the same key (tested). The key is rank 0's, broadcast
  over the process group at start; it sits in checkpoints as the generators' states do today.
  Trust: each rank must run this code honestly for its own shard (a rank that skipped its noise would leave its
  coordinates un-noised). FSDP2 already trusts every rank with the only copy of its shard of the weights and
  optimizer state, so this adds no new party; one rank noising the whole model would need the whole model's
  gradient on that rank, which is what sharding avoids.
* **Ghost clipping: FSDP2 reduces in the second backward pass.** Pass 1 (norms only) runs with gradient sync off
  and forms no weight gradient, so nothing is reduce-scattered or accumulated; pass 2 differentiates
  Σ_i c_i·loss_i and FSDP2's own reduce-scatter (set to a plain sum, every trainable parameter included, so all
  ranks send the same layout) leaves each rank its rows of Σ_ranks; they are taken from ``.grad`` after every
  micro-batch (``add_reduced``) and noised at the step like the reduce-scattered book-keeping sums.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from dptext.errors import UserError
from dptext.privacy.clipping.sums import invariant_tolerance, judge_squared_sums
from dptext.privacy.sharding.fsdp_controls import drop_held_gradients, held_gradients, sum_in_backward
from dptext.privacy.sharding.row_reduce import local_rows, reduce_in_chunks, sum_chunks
from dptext.privacy.noise.optimizer import DPOptimizer
from dptext.privacy.noise.randomness import RandomRoot
from dptext.privacy.proof.step_checks import invariant_failed

HELD = ("FSDP2 still holds clipped sums of this batch that it has not reduced (gradient sync was off for the last "
        "backward pass), which a later step would release into its own update; turn gradient sync back on for the "
        "last micro-batch of each step (set_requires_gradient_sync(True)); the batch was dropped.")
BLOCK = 1 << 16  # coordinates per noise block: a block's generator is seeded once per step
SHARDED_STREAM = 1 << 20  # the noise child's stream for sharded noise, apart from the per-device streams


def is_sharded(param: Tensor) -> bool:
    return hasattr(param, "device_mesh") and hasattr(param, "to_local")


NO_SHARDED_CONTEXT = (
    "This model's parameters are FSDP2 shards (fully_shard), but the privacy engine was given no sharded "
    "distributed context over two or more processes, so it would clip and noise them as whole tensors; pass "
    "distributed=dptext.finetune.distributed.current(device) with sharded=True on every rank under torchrun "
    "(FSDP2 over a single process is not supported: train that model unsharded).")


def check_sharded_context(model: nn.Module, distributed):
    """``distributed`` (the engine's active context or None), refused where the model is FSDP2-sharded and the
    context is missing, of one process, or not marked sharded: without the sharded path book-keeping crashes inside
    DTensor and ghost takes FSDP2's mean over the ranks for its sum (each rank's engine believing it is alone)."""
    if any(is_sharded(param) for param in model.parameters()) and (distributed is None or not distributed.sharded):
        raise UserError(NO_SHARDED_CONTEXT)
    return distributed


def rows_sharded(param: Tensor) -> bool:
    """FSDP2's default layout on a 1-D mesh: the parameter's rows split over the ranks (``Shard(0)``)."""
    from torch.distributed.tensor import Shard

    placements = tuple(param.placements)
    return len(placements) == 1 and isinstance(placements[0], Shard) and placements[0].dim == 0


class ShardedNoise:
    """N(0, std²) for any range of a parameter's flattened coordinates, a function of (key, step, name, index)."""

    def __init__(self, root: RandomRoot, secure: bool = False):
        self.secure = secure
        self.key = int(root.child("noise", stream=SHARDED_STREAM).generate_state(4, np.uint32).view(np.uint64)[0])
        self.step = 0
        self._step_key = self.key

    def share_key(self, broadcast) -> None:
        """Every rank takes rank 0's key (``broadcast``: rank 0's value on every rank), so the noise is one field."""
        self.key = int(broadcast(self.key))

    def reseed_if_secure(self) -> None:
        """Per step: the run's key, or with secure_rng 64 fresh bits from the OS (then each rank draws its own shard
        from its own fresh key: still one draw per coordinate)."""
        self._step_key = int.from_bytes(os.urandom(8), "little") if self.secure else self.key

    def block_seed(self, name: str, block: int) -> int:
        sequence = np.random.SeedSequence(self._step_key, spawn_key=(self.step, zlib.crc32(name.encode()), block))
        words = sequence.generate_state(2, np.uint32)
        return (int(words[0]) | (int(words[1]) << 32)) & ((1 << 63) - 1)

    def normal(self, std: float, name: str, size: int, start: int, count: int, device: torch.device) -> Tensor:
        """The noise of flat coordinates [start, start + count) of parameter ``name`` (``size`` coordinates in all)
        at the current step. Each block is drawn whole, whatever part of it is asked for: torch's normal_ treats
        a tensor's last 16 values differently, so a value depends on the length of the tensor drawn."""
        out = torch.empty(count, dtype=torch.float32, device=device)
        position = start
        while position < start + count:
            block = position // BLOCK
            lo, hi = block * BLOCK, min((block + 1) * BLOCK, size)
            generator = torch.Generator(device=device).manual_seed(self.block_seed(name, block))
            values = torch.empty(hi - lo, dtype=torch.float32, device=device).normal_(0.0, std, generator=generator)
            end = min(hi, start + count)
            out[position - start:end - start] = values[position - lo:end - lo]
            position = end
        return out

    def rows(self, std: float, param: Tensor, name: str, size: int, start: int, count: int,
             device: torch.device) -> Tensor:
        """``normal`` as the sharded optimizer asks it (a correlated filter, ``noise/correlated.py``, also takes
        the parameter, whose state it keeps)."""
        return self.normal(std, name, size, start, count, device)

    def state_dict(self) -> dict:
        return {"sharded_key": self.key, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.key, self.step = int(state["sharded_key"]), int(state["step"])


class ShardedDPOptimizer(DPOptimizer):
    """``DPOptimizer`` for FSDP2-sharded parameters: reduce-scatter of the clipped sums, noise on each rank's own
    rows, the result set as each parameter's sharded gradient."""

    def __init__(self, *args, rank: int, world_size: int, chunks: list[list[nn.Parameter]],
                 layout: str = "all_layer", restore=None, ghost_model: nn.Module | None = None, **kwargs):
        """``chunks``: the groups of whole layers whose clipped sums are reduce-scattered together
        (``row_reduce.sum_chunks``); ``layout``: the clipping layout, for the step's bound; ``restore`` (ghost,
        from ``sum_in_backward``) gives FSDP2 back its own reduction on ``release``."""
        super().__init__(*args, **kwargs)
        self.rank, self.world_size = rank, world_size
        self.chunks, self.layout = chunks, layout
        self.restore = restore
        self.ghost_model = ghost_model  # ghost: FSDP2 reduces the sums, and may hold some back (sync off)
        self.reduced: dict[nn.Parameter, Tensor] = {}

    def add_clipped_sums(self, sums: dict[nn.Parameter, Tensor], units: int) -> None:
        """A micro-batch's full-size clipped sums (per_sample; book-keeping forms them chunk by chunk instead,
        ``clipped_step``): reduced over the ranks a chunk at a time, each sum dropped once sent."""
        reduce_in_chunks(self, self.chunks, lambda chunk: {p: sums.pop(p) for p in chunk if p in sums}, units)

    def add_reduced(self, rows: dict[nn.Parameter, Tensor], units: int) -> None:
        """This rank's rows of Σ_ranks of one micro-batch's clipped sums (``row_reduce``, or FSDP2's reduce-scatter in
        ghost clipping's second pass), and this rank's count of units in it."""
        if self.refusal is not None:
            return
        for param, local in rows.items():
            local = local.float()
            self.reduced[param] = self.reduced[param] + local if param in self.reduced else local
        self.examples_seen += units

    def _checked_reduced(self) -> dict[nn.Parameter, Tensor]:
        """This rank's rows of the logical batch's clipped sum, after the per-step invariant over every
        rank's rows: ‖Σ‖ ≤ (units of all ranks)·C, one all-reduce; every rank reaches the same verdict."""
        grads = {param: self.reduced.pop(param, None) for param in self.params}
        grads = {param: torch.zeros(param.to_local().shape, dtype=torch.float32, device=param.to_local().device)
                 if rows is None else rows for param, rows in grads.items()}
        squares = [torch.linalg.vector_norm(rows, dtype=torch.float64).pow(2) for rows in grads.values()]
        totals = torch.stack(squares + [torch.tensor(float(self.examples_seen), dtype=torch.float64,
                                                     device=squares[0].device)])
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        problem = judge_squared_sums(list(grads), totals[:-1], float(totals[-1]), self.max_grad_norm, self.layout,
                                     len(self.params), invariant_tolerance({torch.float32}))
        if problem is not None:
            self.zero_grad()
            raise invariant_failed(None if problem[0] is None else self.param_names.get(problem[0], "?"), problem[1])
        return grads

    def privatized_grads(self) -> dict[nn.Parameter, Tensor]:
        """(this rank's rows of Σ_ranks Σ_i ḡ_i + its own rows of N(0, σ²C²)) / B, as local fp32 tensors."""
        if self.ghost_model is not None and self.any_rank(held_gradients(self.ghost_model), self.device()):
            self.zero_grad()  # FSDP2 still holds clipped sums of this batch (gradient sync off for its last
            raise UserError(HELD)  # backward): released at a later step they would sit in two steps' updates
        self.collective_verdict()
        self.noise.reseed_if_secure()
        std = self.noise_multiplier * self.max_grad_norm
        grads = self._checked_reduced()
        for param, local in grads.items():
            if std > 0:  # a rank owning no rows of ``param`` still asks (an empty draw): correlated noise keeps
                first, _ = local_rows(param, self.rank, self.world_size)  # the same state on every rank
                width = local.numel() // max(1, local.shape[0]) if local.ndim else 1
                noise = self.noise.rows(std, param, self.param_names.get(param, "?"), param.numel(), first * width,
                                        local.numel(), local.device)
                local.add_(noise.view_as(local))
            local.div_(self.expected_batch_size)
        self.noise.step += 1
        self.zero_grad()
        return grads

    def step(self) -> None:
        from torch.distributed.tensor import DTensor

        self.check_owned()
        for param, local in self.privatized_grads().items():
            param.grad = DTensor.from_local(local.to(param.dtype), param.device_mesh, param.placements,
                                            shape=param.shape, stride=param.stride())
        with self.engine_update():
            self.optimizer.step()
        for param in self.params:
            param.grad = None

    def zero_grad(self) -> None:
        super().zero_grad()
        self.reduced = {}
        if self.ghost_model is not None:
            drop_held_gradients(self.ghost_model)

    def accumulated(self) -> dict[nn.Parameter, Tensor]:
        """This rank's rows of Σ_ranks of the clipped sums accumulated so far (the start-up probe reads them)."""
        return dict(self.reduced)

    def in_logical_batch(self) -> bool:
        return super().in_logical_batch() or bool(self.reduced)

    def release(self) -> None:
        if self.restore is not None:
            self.restore()
            self.restore = None


def sharded_optimizer(engine, optimizer: torch.optim.Optimizer, secure_rng: bool) -> ShardedDPOptimizer:
    """The engine's DP optimizer over FSDP2-sharded parameters, its noise key shared from rank 0."""
    params = set(engine.params)
    planned = {param: name for param, name in engine.param_names().items() if param in params}
    unsharded = [name for param, name in planned.items() if not is_sharded(param)]
    if unsharded:
        raise ValueError(f"parameter '{unsharded[0]}' is not sharded; build the engine after fully_shard")
    other_layout = [name for param, name in planned.items() if not rows_sharded(param)]
    if other_layout:  # the clipped sums are reduce-scattered by rows (row_reduce); columns would get rows' values
        raise UserError(f"Parameter '{other_layout[0]}' is sharded by FSDP2 on another dimension than its rows "
                        "(a shard_placement_fn, or a 2-D mesh); the privacy engine reduces clipped sums by rows "
                        "only, so shard every trained parameter with FSDP2's default Shard(0).")
    noise = ShardedNoise(engine.root, secure_rng)
    noise.share_key(engine.distributed.broadcast)
    context = engine.distributed
    ghost = engine.clipping_mode == "ghost"
    return ShardedDPOptimizer(optimizer, engine.params, engine.noise_multiplier, engine.max_grad_norm,
                              engine.expected_batch_size, noise, rank=context.rank, world_size=context.world_size,
                              chunks=sum_chunks(engine.tracked, engine.params), layout=engine.clipping_layout,
                              restore=sum_in_backward(engine.model) if ghost else None,
                              ghost_model=engine.model if ghost else None,
                              any_rank=context.any_rank)


def noise_site(context) -> str:
    return ", each rank drawing its own shard's coordinates once" if context.sharded else " on rank 0"
