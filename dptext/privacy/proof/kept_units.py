"""Which FSDP2 units the sharded probe keeps gathered from one pass to the next, and how (``proof.sharded_probe``).

The probe makes about ten passes over the model at its first shape (the engine's forward and backward, the
reference's forward and one backward per compared example, a forward per re-drawn example) where a DP step makes
one forward and one backward. Left to FSDP2, each pass gathers every unit again: 9.2 whole-model all-gathers against
a DP step's 1.8 (``benchmarks/sharded_probe_cost.py``), most of the probe's time on a small batch. So the probe keeps
units gathered between its passes, within a budget of memory the run will hold anyway: the probe runs before the
optimizer's first step, and the state that step allocates (Adam's two moments of every parameter, a rank's shard
of each) is at least as large as the kept units' gathered weights. The root is always kept (every pass holds it
from its forward to its backward), as is the one block of a stack cut to one block. Only the engine's own backward
gives the kept units back (book-keeping and per_sample need the shards there,
``fsdp_controls.check_resharded_after_backward``); the next forward gathers them again.

A kept unit must look to the model as training leaves it, and hold what a fresh gather gives, or a model could
tell the probe's passes from training's (red-teamed: ``tests/test_fsdp_kept_redteam.py``). So outside its own
forward and backward a kept unit has its shards registered on its modules, as FSDP2 leaves a unit it gave back
(``looking_sharded``: a model checking whether a block's weight is a DTensor sees what training shows it), and a
write into a kept unit's gathered weights is refused (``proof.kept_checks``): a change of their version counters
(FSDP2's all-gathers keep them), rows of this rank that differ from its shard before any pass (``check_fresh``: a
write through ``.data`` has a counter of its own), or copies that differ between the ranks (``compare_digests``:
marks each rank wrote only into rows another owns). Not covered: code that writes into another rank's rows and
undoes the write before FSDP2 gives the unit back, or that inspects FSDP2's private state; code in the process can
always single out the probe's passes if it sets out to (the batch shapes), and the proof is about code that does not.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch
import torch.distributed as dist
from torch import nn

from dptext.privacy.proof.kept_checks import check_unwritten, compare_digests, gathered_versions, record_digests
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
    rank may keep are compared with this over the world size."""
    if optimizer is None:
        return 0
    return sum(state_per_parameter(optimizer, group) * param.numel() * param.element_size()
               for group in optimizer.param_groups for param in group["params"])


def unit_bytes(unit: nn.Module) -> int:
    """The bytes of ``unit``'s own weights gathered (as stored: the probe gathers in the stored dtype)."""
    return sum(param.sharded_param.numel() * param.sharded_param.element_size()
               for group in unit_groups(unit) for param in group.fsdp_params)


def agreed_budget(engine) -> int:
    """``state_budget`` of the engine's optimizer, the smallest over the ranks (one all-reduce): the units kept
    must be the same on every rank, whose passes are collectives, even where their optimizers differ."""
    budget = torch.tensor([float(state_budget(engine.optimizer))], dtype=torch.float64,
                          device=engine.params[0].device)
    dist.all_reduce(budget, op=dist.ReduceOp.MIN)
    return int(budget.item())


def units_within_budget(model: nn.Module, budget: int, world_size: int) -> list[nn.Module]:
    """The units besides the root to keep gathered, in module order, while the root and they fit ``budget`` (the
    optimizer state of all ranks together, ``agreed_budget``) over the world size. The same on every rank: the
    sizes are of whole tensors."""
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


@contextmanager
def kept_after_forward(view, unit: nn.Module):
    """``unit`` kept gathered after its forward (FSDP2's own setter, as for evaluation) and in ``view.kept`` (kept
    through the reference's backward passes: ``kept_through_backward``), looking sharded between its passes
    (``looking_sharded``); all put back exactly after."""
    groups = unit_groups(unit)
    was = [group.post_forward_mesh_info for group in groups], unit._get_fsdp_state()._auto_reshard_after_forward
    unit.set_reshard_after_forward(False, recurse=False)
    view.kept.append(unit)
    view.ever_kept.add(unit)
    try:
        with looking_sharded(view, unit, groups):
            yield
    finally:
        view.kept.remove(unit)
        for group, info in zip(groups, was[0]):  # put back exactly what the setter wrote
            group.post_forward_mesh_info = info
        unit._get_fsdp_state()._auto_reshard_after_forward = was[1]


@contextmanager
def looking_sharded(view, unit: nn.Module, groups: list):
    """A kept unit registered on its modules as training leaves it between its passes: outside its own forward and
    backward FSDP2 registers the shards (DTensors) there, and model code could tell a kept unit's gathered weights
    from them (a red team's root forward checked whether a block's weight was a DTensor and coupled examples only
    then, which the re-draws on kept blocks never saw). So after the unit's forward and backward its shards are
    registered again while its gathered storage stays (FSDP2's state still says gathered, so its next pre-forward
    or pre-backward gathers nothing), and FSDP2's wait for a gather registers the gathered weights again there, as
    after a real gather (``FSDPParam.to_unsharded``). Patched on these param groups only (instance attributes),
    removed after."""
    def disguised(group):
        if group.is_unsharded:
            for param in group.fsdp_params:
                param._setattr_on_modules(param.sharded_param)

    def waited(group, real):
        def wait_for_unshard(*args, **kwargs):
            real(*args, **kwargs)
            if group.is_unsharded:
                for param in group.fsdp_params:
                    param.to_unsharded()
        return wait_for_unshard

    def then_disguised(group, real):
        def call(*args, **kwargs):
            result = real(*args, **kwargs)
            disguised(group)
            return result
        return call

    def digested_first(group, real):
        def to_sharded(*args, **kwargs):  # FSDP2's reshard, where it really gives the gathered weights back
            if group.is_unsharded:
                record_digests(view, unit)
            return real(*args, **kwargs)
        return to_sharded

    for group in groups:
        group.wait_for_unshard = waited(group, group.wait_for_unshard)
        group.post_forward = then_disguised(group, group.post_forward)
        group.post_backward = then_disguised(group, group.post_backward)
        group._to_sharded = digested_first(group, group._to_sharded)
    try:
        yield
    finally:
        for group in groups:
            for name in ("wait_for_unshard", "post_forward", "post_backward", "_to_sharded"):
                del group.__dict__[name]
            if group.is_unsharded:  # registered as FSDP2's state says, for the resharding after the probe
                for param in group.fsdp_params:
                    param.to_unsharded()


@contextmanager
def kept_gathered(engine):
    """Under sharding, for the probe's duration: the units ``units_within_budget`` chooses kept gathered between
    passes (``kept_after_forward``), and at the end the checks that their weights stayed as gathered
    (``proof.kept_checks``); otherwise nothing."""
    view = view_of(engine)
    if view is None:
        yield
        return
    model = engine.model
    versions = gathered_versions(model)
    view.ever_kept.update(view.kept)
    with ExitStack() as stack:
        for unit in units_within_budget(model, agreed_budget(engine), view.world_size):
            stack.enter_context(kept_after_forward(view, unit))
        yield
    compare_digests(view, model)
    check_unwritten(engine, versions)


@contextmanager
def kept_through_backward(engine):
    """Under sharding, the units the probe keeps gathered (``ShardedView.kept``: the root, those within the budget,
    a cut stack's one block) stay gathered through the backward passes inside the block (the reference's, one per
    compared example over one retained graph) and after it; otherwise nothing. The re-draws' forwards after the
    reference use them as left. The engine's own backward is never inside: book-keeping and per_sample need the
    shards back after it (``fsdp_controls.check_resharded_after_backward``), and FSDP2 reshards every unit there as
    in training."""
    view = view_of(engine)
    groups = [group for unit in (view.kept if view is not None else ()) for group in unit_groups(unit)]
    was = [group.reshard_after_backward for group in groups]
    for unit in view.kept if view is not None else ():
        unit.set_reshard_after_backward(False, recurse=False)  # FSDP2's own setting (for gradient accumulation)
    try:
        yield
    finally:
        for group, flag in zip(groups, was):
            group.reshard_after_backward = flag
        if view is not None:
            aligned_requires_grad(view)


def aligned_requires_grad(view) -> None:
    """Each gathered parameter's ``requires_grad`` set to its shard's, as FSDP2's next gather would set it
    (``to_unsharded``) — inside the probe's hooked forward, whose outside-read detector sees that call. A unit kept
    gathered since the reference (which made its shards require gradients for its passes) is never gathered again
    before the next hooked forward, so its flags are put back here, after the reference gave the shards theirs."""
    for shard, whole in view.gathered.items():
        if whole.requires_grad != shard.requires_grad:
            whole.requires_grad_(shard.requires_grad)


@contextmanager
def cut_block_kept(engine):
    """Under sharding, while the probe runs on a stack cut to one FSDP2 unit besides the root (``proof.stack``;
    a Llama's first decoder layer), that unit stays gathered from one pass to the next (after a forward, and
    through the reference's backward passes: ``kept_through_backward``) even beyond the budget; the engine's
    backward still reshards it. The cut model is then the root and that unit, which each of its passes holds at
    once: keeping them adds nothing to what a pass holds. A cut that keeps more units is left to the budget."""
    view = view_of(engine)
    units = [unit for unit in fsdp_modules(engine.model) if unit is not engine.model] if view is not None else []
    if len(units) != 1 or any(units[0] is kept for kept in view.kept):
        yield
        return
    with kept_after_forward(view, units[0]):
        yield
