"""From one (micro-)batch's backward pass to clipped sums in the logical batch, in each clipping mode (SPEC §1–2).

* book-keeping: norms and clipped sums from the recorded activations and output gradients, (c ⊙ g)ᵀa;
* per_sample: per-example gradients instantiated from the same records, clipped and summed;
* ghost: pass 1 differentiates down to the recorded outputs only (norms), pass 2 differentiates Σ_i c_i·loss_i
  with ordinary autograd (sums). Before pass 1 the graph is checked for tracked parameters read outside their
  modules (``outside_reads``): pass 2 would follow such a path, the norms would not. Under FSDP2 pass 1
  reduce-scatters nothing and pass 2's reduce-scatter hands each rank its rows of every rank's sums
  (``dptext.privacy.sharding.sharded``); a rank without examples runs both passes on a zero loss (``ghost_join``).
Every result goes through the per-step invariant before it joins the logical batch (``step_checks``; ghost under
FSDP2: its bound at the step, over every rank's rows).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext

import torch
from torch import Tensor

from dptext.errors import UserError
from dptext.privacy.clipping import sums as clipping
from dptext.privacy.clipping.call_checks import refuse_selective_checkpoint
from dptext.privacy.sharding.fsdp_controls import (check_resharded_after_backward, check_still_summing,
                                                  check_unshard_in_backward, gradient_sync_off, local_grads)
from dptext.privacy.sharding.row_reduce import reduce_in_chunks
from dptext.privacy.proof.step_checks import check_invariant, checked_uses, deferred_to_the_step
from dptext.privacy.clipping.units import UnitIndex, unit_gradients_instantiated


@contextmanager
def exact_arithmetic(engine):
    """Norms and clipped sums in the engine's own precision: no graph, no recording, and no autocast even when
    ``step`` is called inside an autocast region (it would run the norms' matmuls in bf16)."""
    with ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(engine.recorder.paused())
        for device_type in sorted({p.device.type for p in engine.params}):
            stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def coefficients(engine, norms_sq):
    return clipping.clip_coefficients(norms_sq, engine.max_grad_norm, engine.clipping_layout, len(engine.params))


def units_of_rows(uses: list, units: UnitIndex | None) -> int:
    """Each use's rows mapped from examples to units (``privacy/clipping/units.py``); returns the number of units."""
    if units is None:
        return uses[0].batch_size
    for use in uses:
        use.units = units.of_example[use.units.to(units.of_example.device)].to(use.units.device)
    return units.count


def clip_recorded(engine, per_example_loss: Tensor, units: UnitIndex | None = None) -> Tensor:
    """Book-keeping and per_sample, after the one backward pass: returns the (B,) per-example norms (with
    ``units``, the per-unit norms)."""
    if _sharded(engine):
        _checked(engine, lambda checked: check_resharded_after_backward(checked.model))
    uses = checked_uses(engine, per_example_loss)
    if uses is None:  # refused on this rank (several processes): raised on every rank at the step
        if _sharded(engine):
            join_reduction(engine)
        return refused_norms(per_example_loss, units)
    count = units_of_rows(uses, units)
    with exact_arithmetic(engine):
        if engine.clipping_mode == "bookkeeping":
            norms_sq = clipping.norm_sq_per_parameter(uses, units)
            coef, norms = coefficients(engine, norms_sq)
            if _sharded(engine):
                engine.last_norms_sq = norms_sq if engine.recorder.probing else None
                reduce_bookkeeping(engine, uses, coef, units, norms, count)
                return norms
            # the probe compares only its representatives' sums (proof.patterns): the others are not formed
            only = engine.probe_compared if engine.recorder.probing else None
            sums = clipping.clipped_sums(uses, coef, per_unit=units is not None, only=only)
        else:
            grads = clipping.per_example_grads(uses)
            if units is not None:
                grads = unit_gradients_instantiated(grads, units)
            norms_sq = clipping.norm_sq_from_per_example(grads)
            coef, norms = coefficients(engine, norms_sq)
            sums = clipping.clipped_sums_from_per_example(grads, coef)
        add_checked(engine, sums, norms_sq, norms, count)
    return norms


def reduce_bookkeeping(engine, uses: list, coef, units: UnitIndex | None, norms, count: int) -> None:
    """FSDP2, book-keeping: the clipped sums formed and reduce-scattered a chunk of layers at a time
    (``sharding.row_reduce``), so no full-size sum is held; the bound on them is checked at the step, over every
    rank's rows (the norms are checked here)."""
    check_invariant(engine, {}, norms, count)
    by_param: dict = {}
    for use in uses:
        by_param.setdefault(use.module.get_parameter(use.names[0]), []).append(use)

    def sums_of(chunk):
        chunk_uses = [use for param in chunk for use in by_param.pop(param, [])]
        return clipping.clipped_sums(chunk_uses, coef, per_unit=units is not None)

    optimizer = engine.dp_optimizer
    only = engine.probe_compared if engine.recorder.probing else None  # the probe compares its representatives'
    chunks = optimizer.chunks if only is None else [  # sums only (proof.patterns): the others are neither formed
        compared for chunk in optimizer.chunks if (compared := [param for param in chunk if param in only])]
    view = getattr(engine, "probe_view", None) if only is not None else None  # the probe's vocabulary cut
    reduce_in_chunks(optimizer, chunks, sums_of, count,  # nor reduced (the same set on every rank)
                     view.cut_rows if view is not None else None)


def join_reduction(engine) -> None:
    """FSDP2, book-keeping or per_sample, a rank adding nothing to this micro-batch (refused here, or an empty
    pass): it still joins every chunk's reduce-scatter, with zeros, and keeps its rows of the others' sums."""
    for use in engine.recorder.take_uses():
        use.release()
    reduce_in_chunks(engine.dp_optimizer, engine.dp_optimizer.chunks, None, 0)


def refused_norms(per_example_loss: Tensor, units: UnitIndex | None) -> Tensor:
    """What ``accumulate`` returns for a micro-batch refused on this rank: zeros (no norm was computed; NaN would
    trip a caller's own finiteness check on this rank alone)."""
    count = units.count if units is not None else per_example_loss.numel()
    return torch.zeros(count, device=per_example_loss.device)


def add_checked(engine, sums, norms_sq, norms, units: int) -> None:
    """The per-step invariant, then the sums join the logical batch; a violation writes nothing."""
    engine.last_norms_sq = norms_sq if engine.recorder.probing else None
    check_invariant(engine, sums, norms, units)
    engine.dp_optimizer.add_clipped_sums(sums, units)


def ghost_backward(engine, per_example_loss: Tensor, units: UnitIndex | None = None) -> Tensor:
    """Ghost clipping's two passes; returns the (B,) per-example norms (with ``units``, the per-unit norms)."""
    _check_summing(engine) if _sharded(engine) else _checked(engine, check_no_gradient_hooks)
    refuse_selective_checkpoint(engine, "ghost clipping")
    if not engine.recorder.outputs():  # before the graph walk, which would blame a parameter for it
        engine.recorder.take_uses()
        raise UserError(NOTHING_RECORDED)
    param = engine.outside_reads.outside_read(per_example_loss)
    engine.outside_reads.clear()
    if param is not None and not deferred_to_the_step(engine, outside_read_error(engine, param)):
        engine.recorder.take_uses()  # one process (or the probe): at once
        raise outside_read_error(engine, param)
    # several processes: a read on one rank's data only refuses the batch at the step, on every rank, and this rank
    # joins the others' collectives meanwhile (it used to raise here and leave them waiting; session-26 red team)
    _norm_pass(engine, per_example_loss)
    uses = checked_uses(engine, per_example_loss) if param is None else None
    if param is not None:
        engine.recorder.take_uses()
    if uses is None:  # refused on this rank: under FSDP2 it still joins pass 2's reduce-scatter, adding nothing
        if _sharded(engine):
            engine.dp_optimizer.add_reduced(_sum_pass(engine, per_example_loss * 0), 0)
        return refused_norms(per_example_loss, units)
    count = units_of_rows(uses, units)
    with exact_arithmetic(engine):
        norms_sq = clipping.norm_sq_per_parameter(uses, units)
        coef, norms = coefficients(engine, norms_sq)
    for use in uses:  # pass 2 needs none of them; the retained graph would keep them alive
        use.release()
    del uses
    factor = next(iter(coef.values())).detach()  # all_layer: one factor per unit, shared by every parameter
    if units is not None:
        factor = factor[units.of_example.to(factor.device)]
    sums = _sum_pass(engine, per_example_loss * factor)
    with exact_arithmetic(engine):
        if not _sharded(engine):
            add_checked(engine, sums, norms_sq, norms, count)
            return norms
        # FSDP2: ``sums`` are this rank's rows of every rank's sums; the bound on them is checked at the step
        engine.last_norms_sq = norms_sq if engine.recorder.probing else None
        check_invariant(engine, {}, norms, count)
        engine.dp_optimizer.add_reduced(sums, count)
    return norms


def refuse_outside_read(engine, param) -> None:
    """A parameter whose clipped sum autograd forms (ghost clipping, the hybrid's ghost treatment) read outside
    its layers: a path the norms do not see."""
    raise outside_read_error(engine, param)


def outside_read_error(engine, param) -> UserError:
    # the plan's names: under FSDP2 the model may hold gathered copies of its parameters right now
    name = engine.dp_optimizer.param_names.get(param, tuple(param.shape))
    return UserError(f"Parameter '{name}' is read outside the layers that own it (a functional use such as "
                     "F.linear(h, embed.weight), or a second module reading it), a path ghost clipping's norms do "
                     "not see; nothing from this batch was applied — call the owning module instead, or freeze "
                     "the parameter.")


def ghost_join(engine, per_example_loss: Tensor) -> None:
    """FSDP2, a rank with no examples in this micro-batch: ghost clipping's two passes on ``per_example_loss``
    (a synthetic batch's) times 0, so that it joins the other ranks' all-gathers and reduce-scatters; it adds
    nothing, and keeps its rows of the others' clipped sums, which the reduce-scatter hands it."""
    _check_summing(engine)  # as ghost_backward does on the ranks with examples: all raise together
    refuse_selective_checkpoint(engine, "ghost clipping")
    zero = per_example_loss * 0
    _norm_pass(engine, zero)
    for use in engine.recorder.take_uses():  # dropped unused (the retained graph would keep their tensors alive)
        use.release()
    engine.outside_reads.clear()
    engine.dp_optimizer.add_reduced(_sum_pass(engine, zero), 0)


def _check_summing(engine) -> None:
    """FSDP2 still sums (``fsdp_controls.check_still_summing``), gathers the weights for the backward passes and no
    gradient hook rescales the sums; refused, the forward's records are dropped."""
    _checked(engine, lambda checked: (check_unshard_in_backward(checked.model), check_still_summing(checked.model),
                                      check_no_gradient_hooks(checked)))


def check_no_gradient_hooks(engine) -> None:
    """Ghost clipping takes its clipped sums from autograd's ``.grad``: a hook on a trained parameter's gradient
    (``register_hook``, ``register_post_accumulate_grad_hook``) would rescale them after clipping (a session-25 red
    team's ×1.5 on one block went unseen behind its pattern-mate)."""
    for param in engine.params:
        if getattr(param, "_backward_hooks", None) or getattr(param, "_post_accumulate_grad_hooks", None):
            name = engine.dp_optimizer.param_names.get(param, tuple(param.shape))
            raise UserError(f"Parameter '{name}' has a gradient hook (register_hook or "
                            "register_post_accumulate_grad_hook), through which ghost clipping's clipped sums would "
                            "pass after clipping; remove it, or use privacy.clipping_mode=bookkeeping.")


def _checked(engine, check) -> None:
    """``check(engine)``; refused, the forward's records are dropped first."""
    try:
        check(engine)
    except UserError:
        engine.recorder.take_uses()
        engine.outside_reads.clear()
        raise


def _sharded(engine) -> bool:
    return engine.distributed is not None and engine.distributed.sharded


ACCUMULATED_TWICE = ("This loss was passed to accumulate() already (its backward pass has run and its graph is "
                     "freed); run the model's forward pass again for each accumulate() or step() call.")
NOTHING_RECORDED = (  # ghost's form of ACCUMULATED_TWICE too: the first pass finds no recorded output left
    "No layer output of this loss's forward pass is recorded for ghost clipping: the loss was passed to "
    "accumulate() already, or its layers ran inside activation checkpointing with use_reentrant=True (they run "
    "again only in the backward pass); run the forward pass again for each accumulate() call, checkpoint with "
    "use_reentrant=False, or use clipping_mode='bookkeeping'.")
REENTRANT_CHECKPOINT = (
    "Ghost clipping's first pass is a torch.autograd.grad call on the layers' recorded outputs, which activation "
    "checkpointing with use_reentrant=True does not support; checkpoint with use_reentrant=False (Hugging Face: "
    "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})) or use "
    "clipping_mode='bookkeeping'.")


def backward_once(engine, per_example_loss: Tensor) -> None:
    """Book-keeping and per_sample's one backward pass; a part of the loss's graph freed by an earlier one (a
    slice of a loss accumulated already) is refused in one sentence, before anything joins the batch, and so is
    an FSDP2 unit that would not gather its weights for it (before it starts, on every rank alike)."""
    if _sharded(engine):
        _checked(engine, lambda checked: check_unshard_in_backward(checked.model))
    try:
        per_example_loss.sum().backward()
    except RuntimeError as error:
        if "backward through the graph a second time" not in str(error):
            raise
        raise UserError(ACCUMULATED_TWICE) from None


def _norm_pass(engine, per_example_loss: Tensor) -> None:
    """Pass 1 differentiates only down to the recorded layer outputs: no weight gradients are formed (and under
    FSDP2 nothing is reduce-scattered)."""
    with gradient_sync_off(engine.model) if _sharded(engine) else nullcontext():
        try:
            torch.autograd.grad(per_example_loss.sum(), engine.recorder.outputs(), retain_graph=True,
                                allow_unused=True)
        except RuntimeError as error:  # torch's reentrant checkpoint refuses autograd.grad (it says so by name)
            if "use_reentrant=True" not in str(error):
                raise
            engine.recorder.take_uses()
            raise UserError(REENTRANT_CHECKPOINT) from None


def _sum_pass(engine, weighted_loss: Tensor) -> dict:
    """Pass 2: Σ_i c_i·loss_i differentiated by autograd; under FSDP2 each parameter's gradient is this rank's rows
    of the sum over the ranks (FSDP2's reduce-scatter, ``dptext.privacy.sharding.fsdp_controls.sum_in_backward``)."""
    for param in engine.params:
        param.grad = None
    weighted_loss.sum().backward()
    if _sharded(engine):
        return local_grads(engine.params)
    sums = {param: param.grad for param in engine.params if param.grad is not None}
    for param in engine.params:
        param.grad = None
    return sums
