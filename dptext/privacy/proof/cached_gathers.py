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
known here only the root is copied. The choice is agreed over the ranks (their gathers are collectives). Where the
engine will prove itself, the first gathers are the plan's, made just before the probe (``copies_from_the_plan``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

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


def agreed_budget(engine, device: torch.device | None = None) -> int:
    """``state_budget`` of the engine's optimizer, the smallest over the ranks (one all-reduce): the units copied
    must be the same on every rank, whose gathers are collectives, even where their optimizers differ."""
    budget = torch.tensor([float(state_budget(engine.optimizer))], dtype=torch.float64,
                          device=device or engine.params[0].device)
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


def copied_units(engine, model: nn.Module, world_size: int, device: torch.device | None = None) -> list[nn.Module]:
    """The units whose gathers the probe serves from copies: the root and those within the budget."""
    units = [unit for unit in fsdp_modules(model) if unit is model]
    return units + units_within_budget(model, agreed_budget(engine, device), world_size)


def copyable(group) -> bool:
    """Whether each parameter's all-gather output is the plain concatenation of the ranks' padded shards (dim-0
    sharding, no tensor-subclass extension, no CPU offload): then this rank's part of a copy must equal its shard's
    data, which ``CachedGather.still_valid`` checks; other layouts are always gathered."""
    return all(param.fsdp_placement.dim == 0 and len(param.all_gather_outputs) == 1
               and not hasattr(param._sharded_local_tensor, "fsdp_pre_all_gather") and not param.offload_to_cpu
               for param in group.fsdp_params)


def copies_from_the_plan(engine) -> Callable | None:
    """Where the engine will prove itself (``verify`` on), a function that keeps a copy of each unit's gather as the
    engine's plan makes it (``fsdp_controls.UnitAtATime``), in ``engine.plan_copies``: the probe's first pass is
    then served from them as its later passes are (``cached_gathers``), where it made a real all-gather of every
    unit right after the plan's. Only gathers in the stored dtype (no mixed-precision cast: the probe gathers as
    stored) of the units the probe would copy anyway (``copied_units``); dropped at the model's first forward,
    whether it proves or not (``engine_plan``), and by an adopted proof, ``replan`` and ``detach``."""
    engine.plan_copies = {}
    model = engine.model
    if not fsdp_modules(model) or engine.distributed is None:
        return None
    device = next(model.parameters()).device
    chosen = copied_units(engine, model, engine.distributed.world_size, device)  # (a collective on every rank)

    def keep(unit: nn.Module) -> None:
        if engine.verify_first and any(unit is each for each in chosen):
            for group in unit_groups(unit):
                if group.is_unsharded and copyable(group) and all(param.param_dtype is None
                                                                  for param in group.fsdp_params):
                    engine.plan_copies[group] = [param.all_gather_outputs[0].detach().clone()
                                                 for param in group.fsdp_params]
    return keep


class CachedGather:
    """One FSDP2 param group's all-gathers served from a copy of its first (instance attributes over FSDP2's
    ``unshard`` and ``wait_for_unshard``, removed by ``remove``). Where the copy serves, ``wait_for_unshard`` does
    what FSDP2's own does after an all-gather: the gathered storage allocated and filled (version counters kept),
    the gathered parameters initialised and registered on the modules."""

    def __init__(self, group, device: torch.device, saved: list | None = None):
        self.group, self.device = group, device
        self.saved = saved  # per FSDP2 parameter, its (one) all-gather output as the first gave it (or the plan's)
        self.pending = False  # an unshard served by the copy, filled at the wait
        self.real_unshard, self.real_wait = group.unshard, group.wait_for_unshard
        group.unshard, group.wait_for_unshard = self.unshard, self.wait_for_unshard

    def remove(self) -> None:
        for name in ("unshard", "wait_for_unshard"):
            del self.group.__dict__[name]
        self.saved = None

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
                if self.saved is None and group.is_unsharded and copyable(group):  # a real gather: the copy
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
    device = engine.params[0].device
    groups = [group for unit in copied_units(engine, engine.model, view.world_size) for group in unit_groups(unit)]
    handed = getattr(engine, "plan_copies", None) or {}  # the plan's gathers, made just before (validated alike),
    everywhere = torch.tensor([float(group in handed) for group in groups], device=device)  # used only where every
    if groups:  # rank holds one: a copy's use is a collective, as a gather
        dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
    caches = [CachedGather(group, device, handed[group] if bool(flag) else None)
              for group, flag in zip(groups, everywhere.tolist())]
    engine.plan_copies = None
    try:
        yield
    finally:
        for cache in caches:
            cache.remove()
