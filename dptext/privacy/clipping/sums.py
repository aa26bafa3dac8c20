"""From recorded uses to per-example norms, clipping coefficients and clipped sums (SPEC §1–2).

The whole-model norm is ‖g_i‖² = Σ_p ‖G_{i,p}‖² over parameters p, and a parameter used by several uses u
(tied embedding and LM head; a layer called twice) has G_{i,p} = Σ_u G_{i,p,u}, so
    ‖G_{i,p}‖² = Σ_u ‖G_{i,p,u}‖² + 2 Σ_{u<v} ⟨G_{i,p,u}, G_{i,p,v}⟩.
The cross terms come from the outer-product forms where both rules have one (never a V×d matrix), and from
instantiated gradients otherwise (only small parameters, such as a shared bias, get there).

Clipping: ḡ_i = g_i · min(1, C / (‖g_i‖ + 1e-6)). With the per-layer layout each parameter p has its own
threshold C_p = C / √P, so the clipped whole-model gradient still has norm ≤ C and the noise stays σC.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import Tensor, nn

from dptext.privacy.clipping.use import Use
from dptext.privacy.norms import inner_product
from dptext.privacy.norms.embedding import EmbeddingRule
from dptext.privacy.norms.linear import shared_input_grams
from dptext.privacy.clipping.units import UnitIndex, coefficients_per_row, unit_norm_sq_per_parameter

STABILITY = 1e-6  # the 1e-6 of SPEC §1: ḡ = g · min(1, C / (‖g‖ + 1e-6))


def uses_by_parameter(uses: list[Use]) -> dict[nn.Parameter, list[tuple[Use, str]]]:
    grouped: dict[nn.Parameter, list[tuple[Use, str]]] = defaultdict(list)
    for use in uses:
        for name in use.names:
            grouped[use.module.get_parameter(name)].append((use, name))
    return grouped


def _cross_term(first: tuple[Use, str], second: tuple[Use, str]) -> Tensor:
    (u, u_name), (v, v_name) = first, second
    forms = []
    for use, name in ((u, u_name), (v, v_name)):
        outer_form = getattr(use.rule, "outer_form", None)
        form = outer_form(use.module, (name,), use.activation, use.grad_output) if outer_form else {}
        forms.append(form.get(name))
    if forms[0] is not None and forms[1] is not None:
        return inner_product(forms[0], forms[1])
    grad_u = u.rule.per_example(u.module, (u_name,), u.activation, u.grad_output)[u_name]
    grad_v = v.rule.per_example(v.module, (v_name,), v.activation, v.grad_output)[v_name]
    return (grad_u.float() * grad_v.float()).flatten(1).sum(dim=1)


def _sum_per_parameter(uses: list[Use], per_use, release: bool = False) -> dict[nn.Parameter, Tensor]:
    """Add up ``per_use(use)`` (a {parameter name: tensor} dict) over the uses of each parameter.

    With ``release`` each use's stored tensors are dropped as soon as its share is computed, so the output
    gradients of the layers already summed are freed while later layers are summed (book-keeping's peak)."""
    totals: dict[nn.Parameter, Tensor] = {}
    owned: set[nn.Parameter] = set()  # totals this function allocated, safe to add into in place
    for use in uses:
        for name, value in per_use(use).items():
            param = use.module.get_parameter(name)
            if param not in totals:
                totals[param] = value
            elif param in owned:
                totals[param].add_(value)  # a tied V×d matrix: no third copy while two are alive
            else:
                totals[param] = totals[param] + value
                owned.add(param)
        if release:
            use.release()
    return totals


def norm_sq_per_parameter(uses: list[Use], units: UnitIndex | None = None) -> dict[nn.Parameter, Tensor]:
    """(B,) fp32 squared per-example gradient norm of each parameter, cross terms of shared ones included; with
    ``units``, (count,) per-unit norms of the units' summed gradients (``privacy/clipping/units.py``)."""
    if units is not None:
        return unit_norm_sq_per_parameter(uses_by_parameter(uses), units.count)
    with shared_input_grams():
        norms = _sum_per_parameter(uses, lambda u: u.rule.norm_sq(u.module, u.names, u.activation, u.grad_output))
    for param, param_uses in uses_by_parameter(uses).items():
        for i, first in enumerate(param_uses):
            for second in param_uses[i + 1:]:
                norms[param] = norms[param] + 2 * _cross_term(first, second)
    return norms


def norm_sq_from_per_example(grads: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
    return {param: grad.float().pow(2).flatten(1).sum(dim=1) for param, grad in grads.items()}


def clip_coefficients(norms_sq: dict[nn.Parameter, Tensor], max_grad_norm: float, layout: str,
                      num_groups: int) -> tuple[dict[nn.Parameter, Tensor], Tensor]:
    """Per parameter, the (B,) factors min(1, C / (‖g‖ + 1e-6)); also the (B,) whole-model norms."""
    total = torch.stack(list(norms_sq.values())).sum(dim=0).clamp(min=0).sqrt()
    if layout == "all_layer":
        coef = (max_grad_norm / (total + STABILITY)).clamp(max=1.0)
        return {param: coef for param in norms_sq}, total
    threshold = max_grad_norm / math.sqrt(num_groups)
    return {param: (threshold / (norm_sq.clamp(min=0).sqrt() + STABILITY)).clamp(max=1.0)
            for param, norm_sq in norms_sq.items()}, total


def clipped_sums(uses: list[Use], coef: dict[nn.Parameter, Tensor], per_unit: bool = False,
                 only: set[nn.Parameter] | None = None) -> dict[nn.Parameter, Tensor]:
    """Σ_i c_i G_{i,p} for every parameter, from each use's own weighted reduction (book-keeping); with
    ``per_unit`` the factors are per unit and each row takes its unit's (``use.units``). With ``only`` (the
    probe's compared parameters) a use none of whose parameters is in it is released unsummed.

    The last thing a use's tensors are needed for (the norms and cross terms are known), so each use is released
    as soon as its sum is formed."""
    def coefficients_of(use: Use) -> dict[str, Tensor]:
        use_coef = {name: coef[use.module.get_parameter(name)] for name in use.names}
        return coefficients_per_row(use_coef, use.units) if per_unit else use_coef

    def clipped_sum_of(use: Use) -> dict[str, Tensor]:
        return use.rule.clipped_sum(use.module, use.names, use.activation, use.grad_output, coefficients_of(use))

    if only is not None:
        kept = []
        for use in uses:
            if any(use.module.get_parameter(name) in only for name in use.names):
                kept.append(use)
            else:
                use.release()
        uses = kept
    rows = _row_updates(uses)
    totals = _sum_per_parameter([use for use in uses if use not in rows], clipped_sum_of, release=True)
    for use, param in rows.items():  # after its parameter's other uses: added into their sum, in place
        totals[param] = use.rule.add_clipped_sum(totals[param], use.module, use.activation, use.grad_output,
                                                 coefficients_of(use)["weight"])
        use.release()
    return totals


def _row_updates(uses: list[Use]) -> dict[Use, nn.Parameter]:
    """The embedding uses (``EmbeddingRule.add_clipped_sum``, unmodified ``clipped_sum``) of a parameter that
    another use sums too (a tied embedding and LM head): their rows are added into that use's V×d sum in place,
    so a step holds two V×d matrices instead of three and skips a zero fill and an addition of V×d entries."""
    plain = EmbeddingRule.clipped_sum  # a subclass that changes the sum overrides add_clipped_sum (scaled ones)
    rows = {use: use.module.get_parameter("weight") for use in uses
            if getattr(type(use.rule), "clipped_sum", None) is plain and tuple(use.names) == ("weight",)}
    others = {use.module.get_parameter(name) for use in uses if use not in rows for name in use.names}
    return {use: param for use, param in rows.items() if param in others}


def per_example_grads(uses: list[Use]) -> dict[nn.Parameter, Tensor]:
    """(B, *shape) per-example gradients, summed over the uses of each parameter (the per_sample reference)."""
    return _sum_per_parameter(uses, lambda u: u.rule.per_example(u.module, u.names, u.activation, u.grad_output))


def clipped_sums_from_per_example(grads: dict[nn.Parameter, Tensor],
                                  coef: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
    return {param: torch.tensordot(coef[param].to(grad.dtype), grad, dims=1) for param, grad in grads.items()}


def invariant_tolerance(dtypes) -> float:
    """Relative slack for rounding: sums formed in bf16/fp16 (autocast) round far more than fp32 ones."""
    return 2e-2 if any(dtype in (torch.bfloat16, torch.float16) for dtype in dtypes) else 1e-3


def check_clipped_sums(sums: dict[nn.Parameter, Tensor], norms: Tensor, units: int, max_grad_norm: float,
                       layout: str, num_groups: int) -> tuple[nn.Parameter | None, str] | None:
    """The per-step invariant (issue 23): per-example norms finite, and the clipped sum of ``units`` units within
    units·C (per-layer layout: each parameter within units·C/√P). Returns (parameter, why) on a violation; the
    parameter is None where the failed property belongs to no one parameter (all-layer budget, the norms). Where
    it is one parameter's own (its per-layer budget, its sum not finite) the name stays: it points at the layer
    whose rule is wrong. Which layer that is can depend on the batch, a few bits in an error that ends the run
    and releases nothing; the message carries no value from the batch.

    It runs on private data, so ``why`` names the failed property, never a value from the batch. Triangle
    inequality: ‖Σ_i c_i g_i‖ ≤ Σ_i ‖c_i g_i‖ ≤ units·C whatever the data, so a violation is an engine
    bug (or a non-finite gradient), not bad luck."""
    if not bool(torch.isfinite(norms).all()):
        return None, "a per-example gradient norm is not finite"
    if not sums:
        return None
    tolerance = invariant_tolerance({total.dtype for total in sums.values()})
    params = list(sums)
    # vector_norm reduces (in fp32 at least) without a squared temporary the size of the model
    squares = torch.stack([torch.linalg.vector_norm(
        sums[param], dtype=torch.promote_types(sums[param].dtype, torch.float32)).float().to(norms.device)
        for param in params]).pow(2)
    return judge_squared_sums(params, squares, units, max_grad_norm, layout, num_groups, tolerance)


def judge_squared_sums(params: list[nn.Parameter], squares: Tensor, units: float, max_grad_norm: float,
                       layout: str, num_groups: int, tolerance: float) -> tuple[nn.Parameter | None, str] | None:
    """The invariant's verdict from each parameter's squared clipped-sum norm (``squares[j]`` for ``params[j]``);
    sharded ghost clipping calls it on squares summed over the ranks."""
    if not bool(torch.isfinite(squares).all()):  # one device sync per check, not one per parameter
        return params[int((~torch.isfinite(squares)).nonzero()[0])], "its clipped sum is not finite"
    if layout == "all_layer":
        if float(squares.sum().sqrt()) > units * max_grad_norm * (1 + tolerance):
            # the budget is the whole model's, so no one parameter broke it; naming the largest would point at a
            # culprit that may not be one (and say which layer's gradient was largest on private data)
            return None, "the clipped sum of all parameters together exceeds the batch's budget of units × C"
        return None
    budget = units * max_grad_norm / math.sqrt(num_groups) * (1 + tolerance)
    over = squares.sqrt() > budget
    if bool(over.any()):
        return params[int(over.nonzero()[0])], "its clipped sum exceeds its per-layer budget of units × C/√P"
    return None
