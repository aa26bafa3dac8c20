"""Privacy units: the rows that one clipping factor covers (issue 24, user-level DP).

By default a unit is one example. ``engine.accumulate(loss, units=ids)`` names the unit of each example (a user),
and the clipped quantity of unit u becomes its summed gradient g_u = Σ_{i∈u} g_i, clipped as one vector:
    ‖g_u‖² = Σ_{i∈u} ‖g_i‖² + 2 Σ_{i<j∈u} ⟨g_i, g_j⟩,
with cross terms between the rows of a unit — the same kind of cross terms as tied weights. One mechanism serves
every rule, through the two forms the rules already offer:
* a rule with an outer-product form (Linear, Conv1D, Embedding, ...: G_i = Σ_t left_{i,t} ⊗ right_{i,t}) has its
  rows regrouped so that all positions of all rows of a unit sit side by side in one "row" (padding positions have
  a zero right factor or the no-row id, so they add nothing); the unit's squared norm is then the Gram form of that
  longer row, ⟨G_u, G_u⟩, exactly as a single example's over its tokens;
* any other parameter is instantiated per row (the per_sample reference) and summed per unit (index_add).
Each use carries ``units``, the unit of each of its rows (``capture.Use``), so rules that regroup rows themselves
(shared tables, sequence-first layers) are covered too. Clipped sums need nothing new: Σ_rows c_{u(row)} G_row is
every rule's own weighted sum with the unit's factor repeated on its rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from dptext.errors import UserError
from dptext.privacy.norms.linear import use_ghost_form
from dptext.privacy.norms.outer import OuterForm, inner_product


class UnitIndex(NamedTuple):
    """``of_example[i]``: the unit (0 … count − 1) of example i."""

    of_example: Tensor
    count: int


def unit_index(units, examples: int, device: torch.device) -> UnitIndex | None:
    """The units of a batch of ``examples`` examples, or None where every example is its own unit (today's path)."""
    if units is None:
        return None
    units = torch.as_tensor(units, device=device)
    if units.ndim != 1 or len(units) != examples or units.is_floating_point() or units.is_complex() \
            or units.dtype == torch.bool:
        raise UserError(f"units must be a 1-D integer tensor with one unit id per example ({examples}); got shape "
                        f"{tuple(units.shape)} of {units.dtype}.")
    _, of_example = torch.unique(units, return_inverse=True)
    count = int(of_example.max()) + 1 if examples else 0
    return None if count == examples else UnitIndex(of_example, count)


def positions_by_unit(x: Tensor, units: Tensor, count: int, fill) -> Tensor:
    """(R, T, *rest) → (count, n_max·T, *rest): the positions of all rows of each unit side by side, where n_max
    is the most rows of one unit; the empty places hold ``fill``."""
    order = torch.argsort(units, stable=True)
    sizes = torch.bincount(units, minlength=count)
    starts = torch.cumsum(sizes, 0) - sizes
    sorted_units = units[order]
    slot = torch.arange(len(units), device=units.device) - starts[sorted_units]
    grouped = x.new_full((count, int(sizes.max()), *x.shape[1:]), fill)
    grouped[sorted_units, slot] = x[order]
    return grouped.reshape(count, -1, *x.shape[2:])


def form_by_unit(form: OuterForm, units: Tensor, count: int) -> OuterForm:
    fill = -1 if form.left_is_ids else 0  # -1: the one-hot of no row (padding_idx), as in OuterForm
    return OuterForm(left=positions_by_unit(form.left, units, count, fill),
                     right=positions_by_unit(form.right, units, count, 0))


def sum_by_unit(per_row: Tensor, units: Tensor, count: int) -> Tensor:
    """(R, *shape) → (count, *shape): each unit's rows added up."""
    return per_row.new_zeros((count, *per_row.shape[1:])).index_add_(0, units, per_row)


def _outer_form(use, name: str) -> OuterForm | None:
    outer_form = getattr(use.rule, "outer_form", None)
    return outer_form(use.module, (name,), use.activation, use.grad_output).get(name) if outer_form else None


def unit_gradient(use, name: str, count: int, dense: bool = False) -> OuterForm | Tensor:
    """Parameter ``name``'s per-unit gradient G_u = Σ_{rows of u} G_row in this use: a regrouped outer form where the
    rule has one (no p×d matrix per unit), else (or with ``dense``) instantiated and summed per unit."""
    form = None if dense else _outer_form(use, name)
    rows = len(use.units)
    if form is not None and form.left.shape[0] == form.right.shape[0] == rows:
        return form_by_unit(form, use.units, count)
    per_row = use.rule.per_example(use.module, (name,), use.activation, use.grad_output)[name]
    if per_row.shape[0] != rows:  # fail closed: rows we cannot map to units are never guessed
        raise UserError(f"Parameter '{name}' of {type(use.module).__name__} has per-row gradients that are not one "
                        "per recorded row, so they cannot be grouped into units; use units=None or freeze it.")
    return sum_by_unit(per_row.float(), use.units, count)


def instantiated_if_smaller(form: OuterForm) -> OuterForm | Tensor:
    """The Linear rule's mixed choice for a unit's longer row of P positions: its Gram form costs O(P²), the
    instantiated (count, m, n) gradient O(m·n); the cheaper one (an untied parameter only: no cross term needs it)."""
    if use_ghost_form(form.left.shape[1], form.left.shape[2], form.right.shape[2]):
        return form
    return torch.bmm(form.left.float().transpose(1, 2), form.right.float())


def unit_inner_product(first: OuterForm | Tensor, second: OuterForm | Tensor) -> Tensor:
    """(count,) ⟨G_u, H_u⟩ of two per-unit gradients of one parameter, in fp32."""
    if isinstance(first, OuterForm):
        return inner_product(first, second)
    return (first * second).flatten(1).sum(dim=1)


def unit_norm_sq_per_parameter(uses_of_parameter: dict, count: int) -> dict:
    """(count,) fp32 squared norm of each parameter's per-unit gradient, summed over the uses of the parameter
    (``uses_of_parameter``: parameter → [(use, name)], as ``clipping.uses_by_parameter`` gives), with the cross
    terms between rows of a unit and, for a shared parameter, between its uses."""
    norms = {}
    for param, entries in uses_of_parameter.items():
        grads = [unit_gradient(use, name, count) for use, name in entries]
        if len(grads) == 1 and isinstance(grads[0], OuterForm) and not grads[0].left_is_ids:
            grads = [instantiated_if_smaller(grads[0])]
        if len({isinstance(grad, OuterForm) for grad in grads}) > 1:  # a shared parameter, one use without a form
            grads = [unit_gradient(use, name, count, dense=True) for use, name in entries]
        total = unit_inner_product(grads[0], grads[0])
        for i, first in enumerate(grads):
            if i:
                total = total + unit_inner_product(first, first)
            for second in grads[i + 1:]:
                total = total + 2 * unit_inner_product(first, second)
        norms[param] = total
    return norms


def unit_gradients_instantiated(per_example: dict, units: UnitIndex) -> dict:
    """per_sample mode: (B, *shape) per-example gradients → (count, *shape) per-unit ones."""
    return {param: sum_by_unit(grad, units.of_example, units.count) for param, grad in per_example.items()}


def coefficients_per_row(coef: dict, units: Tensor) -> dict:
    """Each row's clipping factor: the factor of its unit."""
    return {param: factor[units] for param, factor in coef.items()}


class LogicalBatchUnits:
    """The unit ids accumulated into the current logical batch. A unit must arrive in one accumulate call: split
    over two, each part would be clipped to C on its own and the unit could move the sum by 2C."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.seen: set[int] = set()
        self.unnamed = False  # examples accumulated without units (each its own unit, with no id to compare)

    def add(self, units, examples: int) -> None:
        if units is None:
            self.unnamed = self.unnamed or examples > 0
            named = bool(self.seen)
        else:
            ids = set(torch.as_tensor(units).reshape(-1).tolist())
            named = self.unnamed and bool(ids)
            if ids & self.seen:
                raise UserError("A unit's examples were split over two accumulate calls of one logical batch, so "
                                "each part would be clipped to C on its own; pass all of a unit's examples in one "
                                "call (split micro-batches between units, never inside one).")
            self.seen |= ids
        if named:
            raise UserError("One logical batch mixes accumulate calls with and without units, so the units cannot "
                            "be told apart; pass units in every call of the batch, or in none.")
