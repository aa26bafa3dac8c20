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

A kept weight carries whatever a pass writes into it to the next pass, which training (gathering afresh at each
pass) never sees, so a forward that writes into a kept unit's gathered weights in place is refused
(``check_unwritten``); FSDP2's own all-gathers keep the weights' version counters, so any change of one is a write.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from dptext.errors import UserError
from dptext.privacy.proof.sharded_probe import anywhere, unit_groups, view_of
from dptext.privacy.sharding.fsdp_controls import fsdp_modules

WRITTEN = ("The model's forward writes into the gathered weights of '{}' in place (a version change the start-up "
           "probe saw between its passes), which a sharded probe that keeps them gathered cannot follow and training "
           "would not see; remove the in-place write to the weights (or prove the model before fully_shard).")


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


def units_within_budget(model: nn.Module, optimizer, world_size: int) -> list[nn.Module]:
    """The units besides the root to keep gathered, in module order, while the root and they fit the optimizer
    state a rank will hold (``state_budget`` / world size). The same on every rank: sizes are of whole tensors."""
    budget = state_budget(optimizer)
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
    through the reference's backward passes: ``kept_through_backward``), put back exactly after."""
    groups = unit_groups(unit)
    was = [group.post_forward_mesh_info for group in groups], unit._get_fsdp_state()._auto_reshard_after_forward
    unit.set_reshard_after_forward(False, recurse=False)
    view.kept.append(unit)
    view.ever_kept.add(unit)
    try:
        yield
    finally:
        view.kept.remove(unit)
        for group, info in zip(groups, was[0]):  # put back exactly what the setter wrote
            group.post_forward_mesh_info = info
        unit._get_fsdp_state()._auto_reshard_after_forward = was[1]


@contextmanager
def kept_gathered(engine):
    """Under sharding, for the probe's duration: the units ``units_within_budget`` chooses kept gathered between
    passes, and at the end ``check_unwritten``; otherwise nothing."""
    view = view_of(engine)
    if view is None:
        yield
        return
    model = engine.model
    versions = gathered_versions(model)
    view.ever_kept.update(view.kept)
    chosen = units_within_budget(model, engine.optimizer, view.world_size)
    with _each_kept(view, chosen):
        yield
    check_unwritten(engine, versions)


@contextmanager
def _each_kept(view, units: list[nn.Module]):
    if not units:
        yield
        return
    with kept_after_forward(view, units[0]), _each_kept(view, units[1:]):
        yield


def gathered_versions(model: nn.Module) -> dict[nn.Module, list]:
    """Each unit's gathered weights (FSDP2's ``_unsharded_param``) and their version counters now."""
    found = {}
    for unit in fsdp_modules(model):
        found[unit] = [(whole, whole._version) for group in unit_groups(unit) for param in group.fsdp_params
                       if (whole := getattr(param, "_unsharded_param", None)) is not None]
    return found


def check_unwritten(engine, versions: dict[nn.Module, list]) -> None:
    """Refuse, on every rank alike, a model whose passes wrote into a kept unit's gathered weights in place."""
    view = view_of(engine)
    written = next((unit for unit in view.ever_kept for whole, version in versions.get(unit, ())
                    if whole._version != version), None)
    if anywhere(engine, written is not None):
        name = next((name for name, module in engine.model.named_modules() if module is written), None)
        raise UserError(WRITTEN.format(name or type(engine.model).__name__ if written is not None
                                       else "a unit on another rank"))


@contextmanager
def kept_through_backward(engine):
    """Under sharding, the units the probe keeps gathered (``ShardedView.kept``: the root, and on the cut stack its
    one block) stay gathered through the backward passes inside the block (the reference's, one per compared
    example over one retained graph) and after it; otherwise nothing. Each of these passes holds them anyway (FSDP2
    keeps the root gathered from a pass's forward to the end of its backward; a pass on a stack cut to one block
    holds that block with the root), so keeping them between the passes adds nothing to what a pass holds and saves
    their all-gathers at the start of each (the re-draws' forwards after the reference use them as left). The
    engine's own backward is never inside: book-keeping and per_sample need the shards back after it
    (``fsdp_controls.check_resharded_after_backward``), and FSDP2 reshards every unit there as before."""
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
