"""The start-up probe on an FSDP2-sharded model: every rank runs it together, on the same synthetic batch, and no
rank ever holds the whole model (docs/sharding.md, "The proof under sharding").

FSDP2 all-gathers a unit's weights into the same unsharded ``nn.Parameter`` objects at every pass (it refills
their storage and keeps the objects), so the probe learns them once, one unit unsharded at a time
(``ShardedView.gathered``), and uses them where the one-process probe uses the parameters themselves: the
outside-read detector follows them, and the brute-force reference differentiates each compared example's loss
with respect to them (whole gradients of the compared layers only, one per use pattern). The engine's clipped
sums come back reduce-scattered: each rank holds its rows of the sum over the ranks, and every rank ran the same
batch, so they are world_size × the one-process sums; each rank compares its rows with the same rows of the
reference, and one all-reduce of the squared differences gives every rank the same verdict. Every forward and
backward is a collective here, so the probe's control flow must not depend on the rank: its batch is the same
everywhere, every rank makes as many passes, and the ranks' final reports are compared (a difference is refused).
The per-example passes are shared by the ranks (``independence.redraws_of_this_rank``,
``reference.shared_examples``): each re-drawn example and each compared example's backward pass runs on one rank.
"""

from __future__ import annotations

import hashlib
import pickle
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dptext.errors import UserError
from dptext.privacy.sharding.fsdp_controls import (check_unshard_in_backward, fsdp_modules, reset_after_failure,
                                                   sync_off)
from dptext.privacy.sharding.row_reduce import local_rows
from dptext.privacy.sharding.sharded import is_sharded

DIFFERENT_BATCHES = ("The start-up probe's synthetic batch differs between the ranks, so their proofs would be of "
                     "different batches; draw it from the generator make_batch is given (not from the global random "
                     "state, which each rank seeds apart).")
SYNC_OFF = ("Gradient sync is off on this FSDP2 model, so ghost clipping's sums in the start-up probe would not be "
            "reduced; turn it on (set_requires_gradient_sync(True)) before the probe (engine.verify() or the first "
            "training forward).")
DISAGREE = ("The start-up probe reached different verdicts on different ranks ({}), so it proves nothing about "
            "the sharded model; check that every rank builds the same model and runs the same code.")
HALF = ("The start-up probe on a sharded model compares gradients in the precision the weights are stored in, and "
        "this model's are stored in {}, whose rounding would hide a wrong path; keep the weights in fp32 and let "
        "FSDP2's MixedPrecisionPolicy(param_dtype=torch.bfloat16) gather them in bf16 (the probe gathers them in "
        "fp32 for its duration), or prove the model before fully_shard.")


@dataclass
class ShardedView:
    """What the probe needs of the sharding: the unsharded parameter FSDP2 hands the layers for each sharded one,
    and this rank's place."""

    gathered: dict[Tensor, nn.Parameter]
    rank: int
    world_size: int
    planned: dict[tuple[nn.Module, str], Tensor] = field(default_factory=dict)  # (layer, name) -> its shard
    cut_rows: dict[Tensor, int] = field(default_factory=dict)  # shard -> rows its layers see (``proof.vocabulary``)

    def __post_init__(self) -> None:
        # id(unsharded parameter) -> its shard: what a module holds between a forward and its backward
        self.shard_of = {id(whole): shard for shard, whole in self.gathered.items()}

    def target(self, param: Tensor) -> Tensor:
        """The tensor the layers compute with: the unsharded parameter of a shard, else ``param`` itself."""
        return self.gathered.get(param, param)

    def rows(self, whole: Tensor, param: Tensor) -> Tensor:
        """This rank's rows of ``whole``, a tensor of ``param``'s unsharded shape (FSDP2's Shard(0) layout)."""
        return own_rows(whole, param, self.rank, self.world_size)

    def total(self, value: Tensor) -> Tensor:
        """``value`` summed over the ranks (a (1,) fp64 tensor)."""
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value


def own_rows(whole: Tensor, param: Tensor, rank: int, world_size: int) -> Tensor:
    """``rank``'s rows of ``whole``, a tensor of sharded ``param``'s whole shape (FSDP2's Shard(0) layout)."""
    first, count = local_rows(param, rank, world_size)
    return whole[first:first + count] if whole.ndim else whole


def shard_of(engine) -> dict[int, Tensor] | None:
    """Under sharding, id(gathered parameter) -> its shard (``buffers``' fingerprints follow the shards)."""
    view = view_of(engine)
    return view.shard_of if view is not None else None


def anywhere(engine, flag: bool) -> bool:
    """``flag`` on this rank, or under sharding on any rank: where the probe stops early, every rank stops (each
    pass is a collective, so a rank that went on alone would wait for the others for ever)."""
    if view_of(engine) is None:
        return flag
    return engine.distributed.any_rank(flag, engine.params[0].device)


def dealt(count: int, rank: int, world_size: int) -> tuple[list[int], int]:
    """How the ranks share ``count`` per-example passes: the indices this rank takes (i to rank i mod N) and how
    many passes every rank makes (each pass is a collective under FSDP2, so all make as many)."""
    return list(range(rank, count, world_size)), -(-count // world_size)


def raise_on_every_rank(ranks, failed: Exception | None, device: torch.device) -> None:
    """After a pass whose inputs differ between the ranks (a rank's share of the re-draws or of the reference's
    examples): a failure on any rank is raised on every rank, the first failing rank's, so that no rank goes on to
    the next collective alone (it would wait for ever) and every rank refuses alike — where every rank ran every
    pass, a model that fails on one example failed on each rank at the same pass. ``ranks``: the engine's active
    context (None: one process, ``failed`` itself). A failure inside a pass, before that pass's last collective,
    still leaves the other ranks waiting in it (docs/privacy_engine.md, "shared by the ranks")."""
    if ranks is None or not ranks.any_rank(failed is not None, device):
        if failed is not None:
            raise failed
        return
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, _portable(failed))
    first = next(rank for rank, each in enumerate(everyone) if each is not None)
    raise failed if first == dist.get_rank() else everyone[first]


def _portable(error: Exception | None) -> Exception | None:
    """``error`` as it can cross to the other ranks (pickled), or its words in a RuntimeError where it cannot."""
    if error is None:
        return None
    try:
        return pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any exception a model raises must reach the other ranks
        return RuntimeError(f"{type(error).__name__}: {error}")


@contextmanager
def gathered_unit(engine, module: nn.Module):
    """Under sharding, ``module``'s FSDP2 unit gathered for a call outside a pass (the probe's re-run of a layer
    whose batch-1 input was broadcast), given back after; otherwise nothing."""
    if view_of(engine) is None:
        yield
        return
    units = [unit for unit in fsdp_modules(engine.model) if any(m is module for m in unit.modules())]
    unit = min(units, key=lambda each: sum(1 for _ in each.modules()))  # the innermost unit holding it
    unit.unshard()
    try:
        yield
    finally:
        unit.reshard()


def unit_groups(unit: nn.Module) -> list:
    """The FSDP2 param groups of ``unit`` alone (not of the units inside it)."""
    return list(unit._get_fsdp_state()._fsdp_param_groups)


def view_of(engine) -> ShardedView | None:
    """The engine's sharded view while the probe runs on a sharded model, else None (one process)."""
    return getattr(engine, "probe_view", None)


@contextmanager
def sharded_view(engine, model: nn.Module):
    """``engine.probe_view`` for the probe's duration when the engine's parameters are FSDP2 shards."""
    if not any(is_sharded(param) for param in engine.params):
        yield None
        return
    if engine.clipping_mode == "ghost" and sync_off(model):
        raise UserError(SYNC_OFF)
    check_unshard_in_backward(model)  # before the probe's first backward, which it would crash
    for unit in fsdp_modules(model):  # a forward without a backward (an evaluation before the first training
        unit.reshard()                # forward) leaves the root gathered: the modules must hold their shards here
    gathered = gathered_parameters(model)  # every unit resharded after it: the names give the shards
    planned = {(module, name): module.get_parameter(name) for module, (_, names) in engine.tracked.items()
               for name in names}
    engine.probe_view = ShardedView(gathered, dist.get_rank(), dist.get_world_size(), planned)
    without_grad = [param for param in model.parameters() if param.grad is None]
    try:
        yield engine.probe_view
    except BaseException:  # a refusal raised mid-pass (in a backward) leaves FSDP2 inside that pass for the
        reset_after_failure(model)  # model's next engine and training
        raise
    finally:
        del engine.probe_view
        for param in without_grad:  # FSDP2 reduce-scatters zeros into unused parameters' shards in ghost mode
            param.grad = None       # (``set_reduce_scatter_unused_params``) after each reference backward
        for unit in fsdp_modules(model):  # a forward without backward leaves the root gathered: give its rows back
            unit.reshard()


def planned(engine, module: nn.Module, name: str) -> Tensor:
    """The engine's parameter ``name`` of ``module``: under sharding the shard, whichever tensor FSDP2 has
    registered on the module at the moment (the unsharded one between a forward and its backward)."""
    view = view_of(engine)
    return module.get_parameter(name) if view is None else view.planned[(module, name)]


def gathered_parameters(model: nn.Module) -> dict[Tensor, nn.Parameter]:
    """For each sharded parameter of ``model``, the unsharded ``nn.Parameter`` FSDP2 registers on its modules
    during a pass. FSDP2 makes that object at a parameter's first all-gather and keeps it from one pass to the next
    (``FSDPParam._unsharded_param``: refilled in place by each all-gather and set on the modules by
    ``to_unsharded``), so a unit gathered before (the engine's plan gathers every unit, in turn) is read from
    FSDP2's records without an all-gather; any other unit (never gathered, or its gathered parameters dropped by
    ``fsdp_precision`` switching a bf16 policy to the stored dtype) is unsharded and resharded in turn, root first
    (its lazy initialisation covers the others), so at most one unit's weights are whole at a time. Both give the same
    objects (``tests/test_fsdp_probe_gathers.py``)."""
    found: dict[Tensor, nn.Parameter] = {}
    for unit in fsdp_modules(model):
        kept = kept_unsharded(unit)
        found.update(kept if kept is not None else gathered_by_unsharding(unit))
    return found


def kept_unsharded(unit: nn.Module) -> dict[Tensor, nn.Parameter] | None:
    """{shard: the unsharded parameter FSDP2 keeps for it} for every parameter of ``unit`` alone, or None when one
    has none yet (or is not a plain sharded parameter: left to ``gathered_by_unsharding``). Each one's
    ``requires_grad`` is set to its shard's here, as FSDP2's next gather would (``to_unsharded``; book-keeping took
    the shards out of autograd after the plan's gather): that gather runs inside the probe's hooked forward, whose
    outside-read detector sees every torch call on these objects, FSDP2's ``requires_grad_`` included."""
    pairs = {}
    for group in unit_groups(unit):
        for param in group.fsdp_params:
            whole, shard = getattr(param, "_unsharded_param", None), param.sharded_param
            if whole is None or whole is shard or not is_sharded(shard) or is_sharded(whole):
                return None
            pairs[shard] = whole
    for shard, whole in pairs.items():
        if whole.requires_grad != shard.requires_grad:
            whole.requires_grad_(shard.requires_grad)
    return pairs


def gathered_by_unsharding(unit: nn.Module) -> dict[Tensor, nn.Parameter]:
    """``unit``'s {shard: unsharded parameter} as its modules hold them while it is gathered (one all-gather)."""
    found: dict[Tensor, nn.Parameter] = {}
    before = dict(unit.named_parameters(remove_duplicate=False))
    unit.unshard()
    try:
        for name, param in unit.named_parameters(remove_duplicate=False):
            shard = before.get(name)
            if shard is not None and is_sharded(shard) and param is not shard and not is_sharded(param):
                found[shard] = param
    finally:
        unit.reshard()
    return found


def all_zero_on_every_rank(param: Tensor, local_all_zero) -> bool:
    """Whether a sharded parameter is zero on every rank (each sees only its rows): one all-reduce."""
    flag = torch.tensor([1.0 if local_all_zero(param.to_local()) else 0.0], device=param.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() > 0)


def local_tensor(tensor: Tensor) -> Tensor:
    """The rows this rank holds of a sharded tensor; any other tensor itself."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def check_same_batch(engine, batch: dict) -> None:
    """Under sharding, every rank's probe batch must be the same (one all-gather of a digest), else one sentence."""
    if view_of(engine) is None:
        return
    digest = hashlib.sha256()
    for key in sorted(batch, key=str):
        value = batch[key]
        data = value.detach().reshape(-1).double().cpu().numpy().tobytes() if isinstance(value, Tensor) else b""
        digest.update(repr((key, getattr(value, "shape", value) if data else value)).encode() + data)
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest.hexdigest())
    if len(set(digests)) > 1:
        raise UserError(DIFFERENT_BATCHES)


def agreed(table) -> str | None:
    """None when every rank's probe report is ``table``'s (its rows, and whether it found a problem with the loss
    or the state), else the first difference in words."""
    tables: list = [None] * dist.get_world_size()
    dist.all_gather_object(tables, table)
    for rank, other in enumerate(tables):
        if other != table:
            return f"rank {dist.get_rank()} and rank {rank}"
    return None
