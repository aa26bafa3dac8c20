"""The sharded probe's all-gathers served from a copy each rank keeps (``proof.sharded_probe``; issue 42).

The probe makes about ten passes over the model at its first shape (the engine's forward and backward, the
reference's forward and one backward per compared example, a forward per re-drawn example) where a DP step makes
one forward and one backward, and FSDP2 gathers every unit again for each: 9.2 whole-model all-gathers against a DP
step's 1.8 (``benchmarks/sharded_probe_cost.py``), most of the probe's time on a small batch. The shards do not
change while the probe runs (it takes no step), so every gather of a unit after its first gives the same bytes: the
probe keeps, on each rank, a copy of what a unit's first all-gather gave and serves its later gathers from it.
FSDP2 runs exactly as in training otherwise — each unit is given back after its forward and its backward (its
gathered storage freed, its shards registered on its modules), gathered again for the next pass, its gathered
weights registered for that pass — so the model sees what training shows it, and anything a pass writes into its
gathered weights is dropped when FSDP2 gives them back, as in training (a red team built models that told kept
gathered weights from fresh ones, by a mark written into them, by the type or the storage of the registered
weights: ``tests/test_fsdp_kept_redteam*.py``). A copy is used only while every rank's shards hold exactly
what they held when it was taken (each rank's part of the copy against its shard's data, agreed over the ranks:
the probe re-draws all-zero gates into the shards and puts them back, and a model could write into a shard), else
FSDP2 gathers.

The copies cost memory the run holds anyway: the probe runs before the optimizer's first step, and the state that
step allocates (Adam's two moments: a rank's share is 2/N of the model) bounds the units copied besides the root
(whose weights every pass holds from its forward to its backward); with SGD without momentum or an optimizer not
known here only the root is copied. The choice is agreed over the ranks (their gathers are collectives).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from dptext.privacy.proof.sharded_probe import unit_groups, view_of
from dptext.privacy.sharding.fsdp_controls import fsdp_modules


def state_per_parameter(optimizer, group: dict) -> int:
    """How many tensors of its parameter's size ``optimizer`` keeps per parameter of ``group`` after its first step
    (torch's Adam/AdamW: two moments, three with amsgrad; SGD: one with momentum); 0 for optimizers not known here,
    which then keep nothing more than the root."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 3 if group.get("amsgrad") else 2
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if group.get("momentum") else 0
    return 0


def state_budget(optimizer) -> int:
    """Bytes of optimizer state the whole run's ranks will hold together (each its shard): the gathered weights a
    rank may copy are compared with this over the world size."""
    if optimizer is None:
        return 0
    return sum(state_per_parameter(optimizer, group) * param.numel() * param.element_size()
               for group in optimizer.param_groups for param in group["params"])


def unit_bytes(unit: nn.Module) -> int:
    """The bytes of ``unit``'s own weights gathered (as stored: the probe gathers in the stored dtype)."""
    return sum(param.sharded_param.numel() * param.sharded_param.element_size()
               for group in unit_groups(unit) for param in group.fsdp_params)


def agreed_budget(engine) -> int:
    """``state_budget`` of the engine's optimizer, the smallest over the ranks (one all-reduce): the units copied
    must be the same on every rank, whose gathers are collectives, even where their optimizers differ."""
    budget = torch.tensor([float(state_budget(engine.optimizer))], dtype=torch.float64,
                          device=engine.params[0].device)
    dist.all_reduce(budget, op=dist.ReduceOp.MIN)
    return int(budget.item())


def units_within_budget(model: nn.Module, budget: int, world_size: int) -> list[nn.Module]:
    """The units besides the root whose gathers to copy, in module order, while the root and they fit ``budget``
    (the optimizer state of all ranks together, ``agreed_budget``) over the world size. The same on every rank:
    the sizes are of whole tensors."""
    units = fsdp_modules(model)
    held = sum(unit_bytes(unit) for unit in units if unit is model) * world_size
    chosen = []
    for unit in units:
        if unit is model:
            continue
        held += unit_bytes(unit) * world_size
        if held > budget:
            break
        chosen.append(unit)
    return chosen


def own_part(output: torch.Tensor, param) -> torch.Tensor:
    """This rank's part of a parameter's flat all-gather output (the ranks of its shard group side by side: HSDP's
    shard group, not the whole world)."""
    return output.view(param.mesh_info.shard_mesh_size, -1)[param.mesh_info.shard_mesh_rank]


BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bit patterns (compared bit for bit: a value comparison takes -0.0 for 0.0, and a red team's model
    wrote that sign flip into a shard to tell a copy from a fresh all-gather)."""
    return tensor.view(BITS[tensor.element_size()])


class CachedGather:
    """One FSDP2 param group's all-gathers served from a copy of its first (instance attributes over FSDP2's
    ``unshard`` and ``wait_for_unshard``, removed by ``remove``). Where the copy serves, ``wait_for_unshard`` does
    what FSDP2's own does after an all-gather: the gathered storage allocated and filled (version counters kept),
    the gathered parameters initialised and registered on the modules."""

    def __init__(self, group, device: torch.device):
        self.group, self.device = group, device
        self.saved: list | None = None  # per FSDP2 parameter, its (one) all-gather output as the first gave it
        self.pending = False  # an unshard served by the copy, filled at the wait
        self.real_unshard, self.real_wait = group.unshard, group.wait_for_unshard
        group.unshard, group.wait_for_unshard = self.unshard, self.wait_for_unshard

    def remove(self) -> None:
        for name in ("unshard", "wait_for_unshard"):
            del self.group.__dict__[name]
        self.saved = None

    def copyable(self) -> bool:
        """Whether each parameter's all-gather output is the plain concatenation of the ranks' padded shards
        (dim-0 sharding, no tensor-subclass extension, no CPU offload): then this rank's part of the copy must
        equal its shard's data, which ``still_valid`` checks; other layouts are always gathered."""
        return all(param.fsdp_placement.dim == 0 and len(param.all_gather_outputs) == 1
                   and not hasattr(param._sharded_local_tensor, "fsdp_pre_all_gather") and not param.offload_to_cpu
                   for param in self.group.fsdp_params)

    def still_valid(self) -> bool:
        """Whether every rank's shards hold exactly what they held when the copy was taken (this rank's part of the
        copy against its shard's data, any write included; one all-reduce, so every rank decides alike)."""
        with torch.no_grad(), torch._C.DisableTorchFunction():  # unseen by the hooked forward's read detector
            stale = not all(torch.equal(bits(own_part(saved, param)), bits(param._sharded_param_data))
                            for param, saved in zip(self.group.fsdp_params, self.saved))
        flag = torch.tensor([float(stale)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return not bool(flag.item())

    def unshard(self, async_op: bool = False):
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        group = self.group
        if self.pending:
            return None
        if group._all_gather_result is not None or not group.is_sharded or (
                not group.unshard_in_backward and group._training_state == TrainingState.PRE_BACKWARD):
            return self.real_unshard(async_op)  # FSDP2's own no-ops, and a unit resharded after its forward to a
            # smaller mesh (``reshard_after_forward=<int>``), whose next gather keeps what its forward wrote
        if self.saved is not None and self.still_valid():
            self.pending = True
            return None
        self.saved = None
        return self.real_unshard(async_op)

    def wait_for_unshard(self, *args, **kwargs):
        group = self.group
        with torch.no_grad(), torch._C.DisableTorchFunction():  # unseen by the hooked forward's read detector
            if not self.pending:
                self.real_wait(*args, **kwargs)
                if self.saved is None and group.is_unsharded and self.copyable():  # a real gather: the copy
                    self.saved = [param.all_gather_outputs[0].detach().clone() for param in group.fsdp_params]
                return
            self.pending = False
            for param, saved in zip(group.fsdp_params, self.saved):
                param.alloc_all_gather_outputs()
                with torch.autograd._unsafe_preserve_version_counter(tuple(param.all_gather_outputs)):
                    param.all_gather_outputs[0].copy_(saved)
                param.init_unsharded_param()
            group._to_unsharded()


@contextmanager
def cached_gathers(engine):
    """Under sharding, for the probe's duration: the root's gathers and those of the units within the budget
    (``units_within_budget``) served from copies (``CachedGather``); otherwise nothing."""
    view = view_of(engine)
    if view is None:
        yield
        return
    model = engine.model
    units = [unit for unit in fsdp_modules(model) if unit is model]
    units += units_within_budget(model, agreed_budget(engine), view.world_size)
    caches = [CachedGather(group, engine.params[0].device) for unit in units for group in unit_groups(unit)]
    try:
        yield
    finally:
        for cache in caches:
            cache.remove()
