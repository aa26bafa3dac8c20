"""Book-keeping with some layers under the ghost treatment (``long_sequences`` chooses them): one step.

Pass 1 differentiates the loss down to every recorded layer output (``torch.autograd.grad`` on their gradient
edges, graph retained, no weight gradient formed). Each book-keeping layer keeps its records as usual. A layer
under the ghost treatment whose parameters have this one use in the forward has its per-example norm taken in its
gradient hook, from the same rule and records, and its records released there, so its output gradient is never
held past its own backward step; a ghost-treated layer called twice keeps its records until the pass ends (its
norm needs the cross term between the calls). Then every norm is known: book-keeping layers form their clipped
sums (c ⊙ g)ᵀa from their records, and pass 2 differentiates Σ_i c_i·loss_i with respect to the ghost-treated
parameters only (the others are out of autograd), which gives their clipped sums — ghost clipping's second pass.

Fail closed as both modes are: every use goes through the per-step checks (in-place changes, rows that are not
examples, foreign hooks; a use released in its hook keeps what those checks read); before pass 1 the graph is
checked for ghost-treated parameters read outside their modules (``outside_reads``: pass 2 would follow such a
path, the norms would not); the sums go through the per-step invariant; the probe runs this same code.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dptext.errors import UserError
from dptext.privacy.clipping import sums as clipping
from dptext.privacy.clipping.call_checks import refuse_selective_checkpoint
from dptext.privacy.clipping.clipped_step import (NOTHING_RECORDED, REENTRANT_CHECKPOINT, add_checked, coefficients,
                                                  exact_arithmetic, refuse_outside_read, refused_norms, units_of_rows)
from dptext.privacy.clipping.units import UnitIndex
from dptext.privacy.proof.step_checks import checked_uses


def hybrid_backward(engine, per_example_loss: Tensor, units: UnitIndex | None = None) -> Tensor:
    """The hybrid's two passes; returns the (B,) per-example norms (with ``units``, the per-unit norms)."""
    recorder = engine.recorder
    refuse_selective_checkpoint(engine, "the ghost treatment of long sequences (max_stored_bytes)")
    edges = [use.edge for use in recorder.uses if use.edge is not None]
    if not edges:  # the loss was accumulated already (its records are gone), or nothing was recorded
        recorder.take_uses()
        raise UserError(NOTHING_RECORDED)
    param = engine.outside_reads.outside_read(per_example_loss)
    engine.outside_reads.clear()
    if param is not None:
        recorder.take_uses()
        refuse_outside_read(engine, param)
    _first_pass(engine, per_example_loss, edges, early=_norms_in_hook(engine) if units is None else set())
    uses = checked_uses(engine, per_example_loss)
    if uses is None:  # refused on this rank (several processes): raised on every rank at the step
        return refused_norms(per_example_loss, units)
    count = units_of_rows(uses, units)
    ghost = engine.ghost_modules
    with exact_arithmetic(engine):
        recorded = [use for use in uses if use.norm_sq is None]
        norms_sq = clipping.norm_sq_per_parameter(recorded, units) if recorded else {}
        for use in uses:
            for name, value in (use.norm_sq or {}).items():  # one use per parameter: nothing to add to
                norms_sq[use.module.get_parameter(name)] = value
        coef, norms = coefficients(engine, norms_sq)
        for use in recorded:
            if use.module in ghost:  # called twice: records were needed for the norm only
                use.release()
        only = engine.probe_compared if recorder.probing else None
        sums = clipping.clipped_sums([use for use in recorded if use.module not in ghost], coef,
                                     per_unit=units is not None, only=only)
    factor = next(iter(coef.values())).detach()  # all_layer: one factor per unit, shared by every parameter
    if units is not None:
        factor = factor[units.of_example.to(factor.device)]
    reached = list(dict.fromkeys(use.module.get_parameter(name) for use in uses if use.module in ghost
                                 for name in use.names))
    del uses, recorded
    sums.update(_second_pass(per_example_loss * factor, reached))
    with exact_arithmetic(engine):
        add_checked(engine, sums, norms_sq, norms, count)
    return norms


def _norms_in_hook(engine) -> set:
    """The recorded uses whose norm is taken in their gradient hook: ghost-treated, and the only use of their
    parameters in this forward."""
    count: dict = {}
    for use in engine.recorder.uses:
        for name in use.names:
            param = use.module.get_parameter(name)
            count[param] = count.get(param, 0) + 1
    return {use for use in engine.recorder.uses if use.module in engine.ghost_modules and use.problem is None
            and all(count[use.module.get_parameter(name)] == 1 for name in use.names)}


def _first_pass(engine, per_example_loss: Tensor, edges: list, early: set) -> None:
    def norm_now(use) -> None:
        if use not in early or use.problem is not None:
            return
        with exact_arithmetic(engine):
            use.norm_sq = use.rule.norm_sq(use.module, use.names, use.activation, use.grad_output)
        use.release()  # its activation and output gradient are not needed again: pass 2 is autograd's

    engine.recorder.norm_in_hook = norm_now
    try:
        torch.autograd.grad(per_example_loss.sum(), edges, retain_graph=True, allow_unused=True)
    except RuntimeError as error:  # torch's reentrant checkpoint refuses autograd.grad (it says so by name)
        if "use_reentrant=True" not in str(error):
            raise
        engine.recorder.take_uses()
        raise UserError(REENTRANT_CHECKPOINT) from None
    finally:
        engine.recorder.norm_in_hook = None


def _second_pass(weighted_loss: Tensor, params: list) -> dict:
    """Σ_i c_i·loss_i differentiated with respect to the ghost-treated parameters reached in this forward; the
    graph is freed after it."""
    params = [param for param in params if param.requires_grad]  # one frozen since the plan: the step refuses it
    if not params:
        return {}
    grads = torch.autograd.grad(weighted_loss.sum(), params, allow_unused=True)
    return {param: grad for param, grad in zip(params, grads) if grad is not None}
