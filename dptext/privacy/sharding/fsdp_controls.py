"""What dptext sets on FSDP2's own modules (``train.sharding: fsdp``; the DP step itself is
``dptext.privacy.sharding.sharded``): ghost clipping's summed reduce-scatter and its undoing, gradient sync off for its
norm-only pass, each rank's local gradient rows, and the whole weights a numerical rule check needs.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor, nn

from dptext.errors import UserError


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def param_groups(model: nn.Module):
    """(unit, param group) for every FSDP2 param group of ``model``: where FSDP2 keeps each unit's reduction, sync
    and resharding settings and its parameters' gathered state."""
    for module in fsdp_modules(model):
        for group in module._get_fsdp_state()._fsdp_param_groups:
            yield module, group


SUM_SETTERS = ("set_gradient_divide_factor", "set_force_sum_reduction_for_comms", "set_reduce_scatter_unused_params")


def check_resharded_after_backward(model: nn.Module) -> None:
    """Book-keeping and per_sample find each layer's parameter through its module after the backward, where FSDP2
    has put the shard back; a unit kept gathered (``set_reshard_after_backward(False)``, half of FSDP2's gradient
    accumulation idiom) still holds the whole parameter there, whose sums would be dropped (found by the session-25
    red team): refused in one sentence, on every rank alike (the setting is the same on each)."""
    for module, group in param_groups(model):
        if not group.reshard_after_backward:
            raise UserError(f"FSDP2 keeps '{type(module).__name__}' gathered after the backward pass "
                            "(set_reshard_after_backward(False)), which book-keeping and per_sample clipping under "
                            "sharding do not follow; leave it on (gradient sync alone may be turned off between "
                            "micro-batches) or use privacy.clipping_mode=ghost.")


def check_unshard_in_backward(model: nn.Module) -> None:
    """FSDP2 leaves a unit's weights sharded for its backward after ``set_unshard_in_backward(False)`` (meant for
    units no gradient flows through): a backward through its layers then reads weights that are not there (torch's
    raw "data is not allocated" error in book-keeping and per_sample's pass and in ghost clipping's first, and in
    ghost's second even on the root, resharded after the first; a red team's find). Refused in every mode before
    any backward pass and before the probe, on every rank alike (the setting is the same on each)."""
    for module, group in param_groups(model):
        if not getattr(group, "unshard_in_backward", True):
            name = next(name for name, each in model.named_modules() if each is module) or type(module).__name__
            raise UserError(f"FSDP2 does not gather the weights of '{name}' for the backward pass "
                            "(set_unshard_in_backward(False)), which the privacy engine's backward passes need "
                            "(ghost clipping and the start-up probe run several); leave it on "
                            "(set_unshard_in_backward(True)).")


def reset_after_failure(model: nn.Module) -> None:
    """FSDP2's per-pass state put back after an exception ended a forward or backward mid-way (the probe falling
    back from its cut stack or vocabulary): a backward cut short leaves FSDP2 inside it, whose hooks then skip the
    next passes' pre-backward work (the whole model proven next refused every layer: "no gradient recorded").
    Local, no collective (``FSDPModule.reset_iter_state``, on the root; torch 2.13); nothing where no unit has run."""
    for unit in fsdp_modules(model):
        if unit._get_fsdp_state()._is_root and hasattr(unit, "reset_iter_state"):
            unit.reset_iter_state()


def check_ghost_supported() -> None:
    """Ghost clipping under FSDP2 needs FSDP2's reduce-scatter set to a plain sum (``sum_in_backward``)."""
    from torch.distributed.fsdp import FSDPModule

    missing = [name for name in SUM_SETTERS if not hasattr(FSDPModule, name)]
    if missing:
        raise UserError(f"This torch's FSDP2 has no {missing[0]}, which ghost clipping with train.sharding=fsdp "
                        "needs; upgrade torch (2.13 is tested) or use privacy.clipping_mode=bookkeeping.")


REDUCTION = ("gradient_divide_factor", "force_sum_reduction_for_comms", "reduce_scatter_unused_params")
SYNC = ("reduce_grads", "all_reduce_grads")  # what set_requires_gradient_sync writes


def kept_settings(model: nn.Module, names: tuple[str, ...]):
    """The FSDP2 param groups' current values of ``names``; returns the function that puts them back. (torch's
    setters write these attributes of every param group; saving them lets dptext undo exactly what it changed.)"""
    groups = [group for _, group in param_groups(model)]
    saved = [{name: getattr(group, name) for name in names} for group in groups]

    def restore() -> None:
        for group, settings in zip(groups, saved):
            for name, value in settings.items():
                setattr(group, name, value)
    return restore


GHOST_ENGINE = "_dptext_ghost_sum"  # set on an FSDP2 model while a ghost engine's summed reduction is in force


def check_no_other_ghost_engine(model: nn.Module) -> None:
    """One ghost engine per FSDP2 model: each saves the reduction it found and puts it back on detach, so a second
    one would save the first one's sum, and detaching them out of order would leave one averaging (its clipped
    sums divided by the ranks) or the model summing after every engine is gone."""
    if getattr(model, GHOST_ENGINE, False):
        raise UserError("This FSDP2 model already has a ghost-clipping privacy engine; call that engine's detach() "
                        "before building another on the same model.")


def sum_in_backward(model: nn.Module):
    """FSDP2's reduce-scatter as ghost clipping's second pass needs it: a plain sum over the ranks (not the mean,
    and SUM rather than a pre-multiplied sum, which gloo lacks), and every trainable parameter sent even when a
    rank's pass gave it no gradient, so that all ranks reduce-scatter the same layout. Returns the function that
    puts FSDP2's own settings back (``engine.detach``: training on without DP must average again)."""
    check_ghost_supported()  # (the engine ran check_no_other_ghost_engine before attaching its hooks)
    restore = kept_settings(model, REDUCTION)
    for module in fsdp_modules(model):
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
        module.set_reduce_scatter_unused_params(True, recurse=False)
    setattr(model, GHOST_ENGINE, True)

    def release() -> None:
        restore()
        setattr(model, GHOST_ENGINE, False)
    return release


def check_still_summing(model: nn.Module) -> None:
    """Before each ghost micro-batch, one with examples or an empty one (``ghost_join``): the reduction is still
    what ``sum_in_backward`` set. Changed since (``set_gradient_divide_factor`` by hand), the second pass would hand
    back the ranks' mean, silently wrong sums (or, unused parameters no longer sent, layouts that differ between
    ranks); the settings are the same on every rank, so every rank raises here together, before any collective."""
    syncing = any(group.reduce_grads for _, group in param_groups(model))
    for module, group in param_groups(model):
        if (group.gradient_divide_factor != 1.0 or not group.force_sum_reduction_for_comms
                or not group.reduce_scatter_unused_params):
            raise UserError("FSDP2's gradient reduction on this model was changed after the privacy engine set "
                            "it to a plain sum of every parameter, so ghost clipping's sums would be wrong; leave "
                            "the reduction settings alone while the engine is attached (detach() it first).")
        changed = reduction_changed(group) or (
            "gradient sync off on this unit only" if syncing and not group.reduce_grads else None)
        if changed:
            raise UserError(f"FSDP2 reduces the gradients of '{type(module).__name__}' with {changed}, so ghost "
                            "clipping's clipped sums (which FSDP2 reduces) would not be their plain sum; remove "
                            "it while the engine is attached, or use privacy.clipping_mode=bookkeeping.")


def sync_off(model: nn.Module) -> bool:
    """Whether gradient sync is off on some FSDP2 unit (``set_requires_gradient_sync(False)``)."""
    return any(not group.reduce_grads for _, group in param_groups(model))


def held_gradients(model: nn.Module) -> bool:
    """Whether FSDP2 holds gradients it has not reduce-scattered (gradient sync was off for a backward): in ghost
    clipping those are clipped sums that a later reduce-scatter would release into another step's update."""
    for _, group in param_groups(model):
        for param in group.fsdp_params:
            whole = getattr(param, "_unsharded_param", None)
            if getattr(param, "unsharded_accumulated_grad", None) is not None or (
                    whole is not None and whole.grad is not None):
                return True
    return False


def drop_held_gradients(model: nn.Module) -> None:
    """Forget what ``held_gradients`` finds (a logical batch dropped with ``zero_grad`` drops them too)."""
    for _, group in param_groups(model):
        for param in group.fsdp_params:
            param.unsharded_accumulated_grad = None
            whole = getattr(param, "_unsharded_param", None)
            if whole is not None:
                whole.grad = None


PLAIN_REDUCE_SCATTER = ("DefaultReduceScatter", "ProcessGroupAllocReduceScatter", "SymmMemReduceScatter")  # torch's
# own: they differ in where the buffers are allocated, not in what is summed


def reduction_changed(group) -> str | None:
    """What makes an FSDP2 param group's reduce-scatter other than a plain full-precision sum, in words, or None:
    a hook on its output (``set_all_reduce_hook``: found by the session-25 red team, ×1.5 on one block went
    unseen), a custom reduce-scatter, or a reduce dtype below fp32 (sums rounded to bf16; a bf16 policy without a
    reduce dtype reduces in bf16)."""
    if getattr(group, "_all_reduce_hook", None) is not None:
        return "a hook on the reduced gradients (set_all_reduce_hook)"
    comm = getattr(group, "_reduce_scatter_comm", None)
    if comm is not None and type(comm).__name__ not in PLAIN_REDUCE_SCATTER:
        return f"a custom reduce-scatter ({type(comm).__name__})"
    dtype = getattr(group, "_reduce_dtype", None) or next(  # None: reduced in the dtype the weights are gathered in
        (param.param_dtype for param in group.fsdp_params if getattr(param, "param_dtype", None) is not None), None)
    if dtype is not None and dtype.is_floating_point and torch.finfo(dtype).bits < 32:
        return f"a {dtype} reduce dtype"
    return None


@contextmanager
def gradient_sync_off(model: nn.Module):
    """Ghost clipping's first (norm-only) pass: FSDP2 reshards after it but must not reduce-scatter. Afterwards the
    sync settings are what they were (a caller's own ``set_requires_all_reduce(False)`` included), not forced on."""
    restore = kept_settings(model, SYNC)
    for module in fsdp_modules(model):
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        restore()


def local_grads(params: list[nn.Parameter]) -> dict[nn.Parameter, Tensor]:
    """Each sharded parameter's gradient as this rank's local rows; the gradients are then dropped."""
    rows = {param: param.grad.to_local() for param in params if param.grad is not None}
    for param in params:
        param.grad = None
    return rows


class UnitAtATime:
    """FSDP2, while the engine plans: a layer's own unit gathered where a rule must run it (a structural match such
    as RMSNorm's is confirmed numerically, which a sharded weight cannot do), at most one unit at a time — the plan
    never holds the whole model on a rank, which a model loaded on the meta device never held either — and then
    every unit gathered once in turn (``prime``): FSDP2 makes a unit's unsharded parameters at its first all-gather,
    and the probe learns them from FSDP2's records without another (``proof.sharded_probe.kept_unsharded``). Every
    rank makes the same calls in the same order (the plan visits the same model's layers in order), as each gather
    is a collective. Without FSDP2 units nothing is gathered."""

    def __init__(self, model: nn.Module, keep=None):
        self.keep = keep  # called with each unit just gathered (the probe keeps copies: ``proof.cached_gathers``)
        self.units = fsdp_modules(model)
        self.unit_of = {module: unit for unit in self.units for module in unit.modules()}  # inner units last: theirs
        self.current = None
        self.done: list[nn.Module] = []

    @contextmanager
    def gathered(self, module: nn.Module):
        """``module``'s innermost unit gathered inside (kept until another unit is needed, or ``release``)."""
        unit = self.unit_of.get(module)
        if unit is not None and unit is not self.current:
            self._gather(unit)
        yield

    def _gather(self, unit: nn.Module) -> None:
        self.release()
        unit.unshard()
        self.current = unit
        self.done.append(unit)
        if self.keep is not None:
            self.keep(unit)

    def prime(self) -> None:
        """Every unit not gathered yet, once, one at a time."""
        for unit in self.units:
            if not any(unit is done for done in self.done):
                self._gather(unit)
        self.release()

    def release(self) -> None:
        if self.current is not None:
            self.current.reshard()
            self.current = None
