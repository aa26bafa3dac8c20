"""The checks that keep the sharded probe's kept units honest (``proof.kept_units``): a kept unit's gathered
weights must hold, before every pass and until FSDP2 gives them back, exactly what a fresh all-gather gives.

- ``gathered_versions``/``check_unwritten``: no version change of a kept unit's gathered weights (an in-place write;
  FSDP2's own all-gathers keep the counters), decided at the end over every rank, in one sentence.
- ``with_fresh_weights``/``check_fresh``: before every pass, this rank's rows of each gathered unit equal its shard
  (a write through ``.data`` has a version counter of its own).
- ``record_digests``/``compare_digests``: every rank's whole copy equals the others' (``digest`` of each weight,
  taken before FSDP2 gives a unit back and at the end; marks each rank wrote only into rows another owns).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dptext.errors import UserError
from dptext.privacy.proof.sharded_probe import anywhere, unit_groups, view_of
from dptext.privacy.sharding.fsdp_controls import fsdp_modules

WRITTEN = ("The model's forward writes into the gathered weights of '{}' in place (the start-up probe found them "
           "changed between its passes), which a sharded probe that keeps them gathered cannot follow and training "
           "would not see; remove the in-place write to the weights (or prove the model before fully_shard).")


def gathered_versions(model: nn.Module) -> dict[nn.Module, list]:
    """Each unit's gathered weights (FSDP2's ``_unsharded_param``) and their version counters now."""
    found = {}
    for unit in fsdp_modules(model):
        found[unit] = [(whole, whole._version) for group in unit_groups(unit) for param in group.fsdp_params
                       if (whole := getattr(param, "_unsharded_param", None)) is not None]
    return found


def with_fresh_weights(engine, loss_fn):
    """Under sharding, ``loss_fn`` checking first, before every pass of the probe, that each unit still gathered
    from an earlier pass holds exactly what a fresh all-gather would give it (``check_fresh``): a write through
    ``.data`` has a version counter of its own (a red team's model marked its kept weights that way, told the
    probe's kept passes from training's fresh ones and coupled examples only in the latter). Findings are decided
    at the end, over every rank (``check_unwritten``). Otherwise ``loss_fn`` itself."""
    view = view_of(engine)
    if view is None:
        return loss_fn

    def checked(model, batch):
        check_fresh(view, model)
        return loss_fn(model, batch)
    return checked


BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
CHUNK = 1 << 20  # entries per step of ``digest``


def digest(whole: Tensor) -> Tensor:
    """Σ (i + 1)·bits_i over the flat entries of ``whole`` (int64, wrapping): equal for equal tensors, and moved by
    a change of any entry or an exchange of two (a plain sum missed marks two ranks wrote into each other's rows).
    In chunks, so that no temporary is larger than a chunk."""
    flat = whole.detach().reshape(-1).view(BITS[whole.element_size()])
    positions = torch.arange(1, min(CHUNK, flat.numel()) + 1, dtype=torch.int64, device=flat.device)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), CHUNK):
        bits = flat[start:start + CHUNK].to(torch.int64)
        total += (bits * positions[:len(bits)]).sum() + start * bits.sum()
    return total


def gathered_params(unit: nn.Module):
    """(FSDP2 parameter, its gathered weight) for each of ``unit``'s own parameters gathered now."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState  # private: torch 2.13 is pinned

    for group in unit_groups(unit):
        for param in group.fsdp_params:
            whole = getattr(param, "_unsharded_param", None)
            if whole is not None and param.sharded_state == ShardedState.UNSHARDED and whole.ndim > 0:
                yield param, whole


def check_fresh(view, model: nn.Module) -> None:
    """Adds to ``view.written`` each unit gathered now whose rows of this rank differ from its shard (what a fresh
    all-gather gives them). Rank-local: marks written only into rows another rank owns are ``record_digests``'."""
    with torch.no_grad(), torch._C.DisableTorchFunction():  # unseen by the hooked forward's read detector
        for unit in fsdp_modules(model):
            for param, whole in gathered_params(unit):
                if not torch.equal(view.rows(whole, param.sharded_param), param.sharded_param.to_local()):
                    view.written.add(unit)


def record_digests(view, unit: nn.Module) -> None:
    """``unit``'s gathered weights' digests, before they are given back (and at the end of the probe): every rank's
    copy must equal every other's (``compare_digests``), which with each rank's own rows (``check_fresh``) makes
    every entry as gathered. A red team's ranks each marked only the rows the other owns."""
    with torch.no_grad(), torch._C.DisableTorchFunction():
        view.digests.append((id(unit), [int(digest(whole)) for _, whole in gathered_params(unit)]))
    view.digest_units[id(unit)] = unit


def compare_digests(view, model: nn.Module) -> None:
    """At the end of the probe: the units still gathered recorded too, then every rank's digests compared (one
    all-gather of the lists, taken at the same points on every rank); a unit whose copies differ between the ranks
    joins ``view.written``."""
    for unit in fsdp_modules(model):
        record_digests(view, unit)
    mine = [values for _, values in view.digests]
    every: list = [None] * view.world_size
    dist.all_gather_object(every, mine)
    for other in every:
        if len(other) != len(mine):  # taken at other points: nothing can be compared
            view.written.update(view.digest_units.values())
            return
        view.written.update(view.digest_units[index] for (index, values), theirs in zip(view.digests, other)
                            if values != theirs)


def check_unwritten(engine, versions: dict[nn.Module, list]) -> None:
    """Refuse, on every rank alike, a model whose passes wrote into a kept unit's gathered weights in place (a
    version change, or rows that differ from the shard before a pass: ``with_fresh_weights``)."""
    view = view_of(engine)
    written = next((unit for unit in view.ever_kept for whole, version in versions.get(unit, ())
                    if whole._version != version), None) or next(iter(view.written), None)
    if anywhere(engine, written is not None):
        name = next((name for name, module in engine.model.named_modules() if module is written), None)
        raise UserError(WRITTEN.format(name or type(engine.model).__name__ if written is not None
                                       else "a unit on another rank"))
