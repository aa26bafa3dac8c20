"""From one (micro-)batch's backward pass to clipped sums in the logical batch, in each clipping mode (SPEC §1–2).

* book-keeping: norms and clipped sums from the recorded activations and output gradients, (c ⊙ g)ᵀa;
* per_sample: per-example gradients instantiated from the same records, clipped and summed;
* ghost: pass 1 differentiates down to the recorded outputs only (norms), pass 2 differentiates Σ_i c_i·loss_i
  with ordinary autograd (sums). Before pass 1 the graph is checked for tracked parameters read outside their
  modules (``outside_reads``): pass 2 would follow such a path, the norms would not.
Every result goes through the per-step invariant before it joins the logical batch (``step_checks``).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch
from torch import Tensor

from dptext.errors import UserError
from dptext.privacy import clipping
from dptext.privacy.step_checks import check_invariant, checked_uses
from dptext.privacy.units import UnitIndex, unit_gradients_instantiated


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
    """Each use's rows mapped from examples to units (``privacy/units.py``); returns the number of units."""
    if units is None:
        return uses[0].batch_size
    for use in uses:
        use.units = units.of_example[use.units.to(units.of_example.device)].to(use.units.device)
    return units.count


def clip_recorded(engine, per_example_loss: Tensor, units: UnitIndex | None = None) -> Tensor:
    """Book-keeping and per_sample, after the one backward pass: returns the (B,) per-example norms (with
    ``units``, the per-unit norms)."""
    uses = checked_uses(engine, per_example_loss)
    count = units_of_rows(uses, units)
    with exact_arithmetic(engine):
        if engine.clipping_mode == "bookkeeping":
            norms_sq = clipping.norm_sq_per_parameter(uses, units)
            coef, norms = coefficients(engine, norms_sq)
            sums = clipping.clipped_sums(uses, coef, per_unit=units is not None)
        else:
            grads = clipping.per_example_grads(uses)
            if units is not None:
                grads = unit_gradients_instantiated(grads, units)
            norms_sq = clipping.norm_sq_from_per_example(grads)
            coef, norms = coefficients(engine, norms_sq)
            sums = clipping.clipped_sums_from_per_example(grads, coef)
        add_checked(engine, sums, norms_sq, norms, count)
    return norms


def add_checked(engine, sums, norms_sq, norms, units: int) -> None:
    """The per-step invariant, then the sums join the logical batch; a violation writes nothing."""
    engine.last_norms_sq = norms_sq if engine.recorder.probing else None
    check_invariant(engine, sums, norms, units)
    engine.dp_optimizer.add_clipped_sums(sums, units)


def ghost_backward(engine, per_example_loss: Tensor, units: UnitIndex | None = None) -> Tensor:
    """Ghost clipping's two passes; returns the (B,) per-example norms (with ``units``, the per-unit norms)."""
    param = engine.outside_reads.outside_read(per_example_loss)
    engine.outside_reads.clear()
    if param is not None:
        engine.recorder.take_uses()
        raise UserError(f"Parameter '{engine.param_names().get(param, tuple(param.shape))}' is read outside the "
                        "layers that own it (a functional use such as F.linear(h, embed.weight), or a second module "
                        "reading it), a path ghost clipping's norms do not see; nothing from this batch was "
                        "applied — call the owning module instead, or freeze the parameter.")
    # Pass 1 differentiates only down to the recorded layer outputs: no weight gradients are formed.
    torch.autograd.grad(per_example_loss.sum(), engine.recorder.outputs(), retain_graph=True, allow_unused=True)
    uses = checked_uses(engine, per_example_loss)
    count = units_of_rows(uses, units)
    with exact_arithmetic(engine):
        norms_sq = clipping.norm_sq_per_parameter(uses, units)
        coef, norms = coefficients(engine, norms_sq)
    for use in uses:  # pass 2 needs none of them; the retained graph would keep them alive
        use.release()
    del uses
    for param in engine.params:
        param.grad = None
    factor = next(iter(coef.values())).detach()  # all_layer: one factor per unit, shared by every parameter
    if units is not None:
        factor = factor[units.of_example.to(factor.device)]
    (per_example_loss * factor).sum().backward()
    sums = {param: param.grad for param in engine.params if param.grad is not None}
    for param in engine.params:
        param.grad = None
    with exact_arithmetic(engine):
        add_checked(engine, sums, norms_sq, norms, count)
    return norms
