"""nn.Linear, including the A and B matrices of peft LoRA adapters (they are nn.Linear too).

y_t = W a_t + b with W ∈ R^{p×d}. The per-example weight gradient is G_i = Σ_t g_t a_tᵀ = g_iᵀ a_i (SPEC §2).
Its squared norm has two forms:
* ghost:        ‖G_i‖² = Σ_{s,t} (a_s·a_t)(g_s·g_t) = ⟨a aᵀ, g gᵀ⟩   O(T²(d+p)) time, O(T²) memory;
* instantiated: form G_i and square it                              O(Tpd) time, O(pd) memory.
The mixed rule takes the ghost form when 2T² < p·d, per layer and per call (T changes between batches).
With T = 1 both reduce to ‖a‖²‖g‖². Bias: ‖Σ_t g_t‖².
Whatever form gave the norm, the clipped sum is one weighted GEMM, Σ_i c_i G_i = (c ⊙ g)ᵀ a.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor, nn

from dptext.privacy.norms.outer import OuterForm
from dptext.privacy.norms.registry import register_rule, register_rule_by_name


def as_sequences(x: Tensor) -> Tensor:
    """(B, d) or (B, ..., d) → (B, T, d): every leading position of one example is a "token"."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


def use_ghost_form(positions: int, out_features: int, in_features: int) -> bool:
    return 2 * positions * positions < out_features * in_features


# Layers fed the same input tensor (q/k/v projections, gate/up) need the same input Gram a aᵀ, and their uses come
# one after another in forward order: within one norm pass the last input's Gram is kept for the next layer. The key
# is the input's memory (address, layout, dtype, version counter) and the slot holds the tensor itself, so no other
# tensor can own that address meanwhile: equal keys mean equal bytes. One slot: memory stays one B×T×T Gram.
_LAST_INPUT_GRAM: ContextVar[list | None] = ContextVar("last_input_gram", default=None)


@contextmanager
def shared_input_grams():
    token = _LAST_INPUT_GRAM.set([None, None, None])  # key, tensor, Gram
    try:
        yield
    finally:
        _LAST_INPUT_GRAM.reset(token)


def _gram(x: Tensor) -> Tensor:
    x = x.float()
    return torch.bmm(x, x.transpose(1, 2))


def input_gram(a: Tensor) -> Tensor:
    slot = _LAST_INPUT_GRAM.get()
    if slot is None:
        return _gram(a)
    key = (a.data_ptr(), tuple(a.shape), a.stride(), a.dtype, a.device, a._version)
    if slot[0] != key:
        slot[:] = [key, a, _gram(a)]
    return slot[2]


def ghost_norm_sq(a: Tensor, g: Tensor) -> Tensor:
    if a.shape[1] == 1:
        return a.float().pow(2).sum(dim=(1, 2)) * g.float().pow(2).sum(dim=(1, 2))
    return (input_gram(a) * _gram(g)).sum(dim=(1, 2))


def instantiated_norm_sq(a: Tensor, g: Tensor) -> Tensor:
    return torch.bmm(g.float().transpose(1, 2), a.float()).pow(2).sum(dim=(1, 2))


def weight_norm_sq(a: Tensor, g: Tensor) -> Tensor:
    """The mixed rule: (B,) squared norms of G_i = g_iᵀ a_i, for a (B, T, d) and g (B, T, p)."""
    if use_ghost_form(a.shape[1], g.shape[2], a.shape[2]):
        return ghost_norm_sq(a, g)
    return instantiated_norm_sq(a, g)


def weighted_outer_sum(coef: Tensor, left: Tensor, right: Tensor) -> Tensor:
    """Σ_i coef_i Σ_t left_{i,t} right_{i,t}ᵀ as one GEMM over all B·T positions."""
    dtype = torch.promote_types(left.dtype, right.dtype)
    # Scale the narrower factor: for an LM head that is a (B, T, d), not the (B, T, V) output gradient.
    if left.shape[-1] <= right.shape[-1]:
        left = left * coef.to(left.dtype)[:, None, None]
    else:
        right = right * coef.to(right.dtype)[:, None, None]
    return left.to(dtype).reshape(-1, left.shape[-1]).t() @ right.to(dtype).reshape(-1, right.shape[-1])


@register_rule(nn.Linear)
class LinearRule:
    # G_i = Σ_t left_t ⊗ right_t with (left, right) = (g, a) for W ∈ R^{p×d}; Conv1D flips them.
    weight_is_transposed = False

    def keep(self, module: nn.Module, inputs: tuple) -> Tensor:
        return inputs[0]

    def _left_right(self, activation: Tensor, grad_output: Tensor) -> tuple[Tensor, Tensor]:
        a, g = as_sequences(activation), as_sequences(grad_output)
        return (a, g) if self.weight_is_transposed else (g, a)

    def norm_sq(self, module, names, activation, grad_output) -> dict[str, Tensor]:
        a, g = as_sequences(activation), as_sequences(grad_output)
        norms = {}
        if "weight" in names:
            norms["weight"] = weight_norm_sq(a, g)
        if "bias" in names:
            norms["bias"] = g.float().sum(dim=1).pow(2).sum(dim=1)
        return norms

    def clipped_sum(self, module, names, activation, grad_output, coef) -> dict[str, Tensor]:
        sums = {}
        if "weight" in names:
            sums["weight"] = weighted_outer_sum(coef["weight"], *self._left_right(activation, grad_output))
        if "bias" in names:
            g = as_sequences(grad_output)
            sums["bias"] = coef["bias"].to(g.dtype) @ g.sum(dim=1)
        return sums

    def per_example(self, module, names, activation, grad_output) -> dict[str, Tensor]:
        grads = {}
        if "weight" in names:
            left, right = self._left_right(activation, grad_output)
            dtype = torch.promote_types(left.dtype, right.dtype)
            grads["weight"] = torch.bmm(left.to(dtype).transpose(1, 2), right.to(dtype))
        if "bias" in names:
            grads["bias"] = as_sequences(grad_output).sum(dim=1)
        return grads

    def outer_form(self, module, names, activation, grad_output) -> dict[str, OuterForm]:
        left, right = self._left_right(activation, grad_output)
        return {"weight": OuterForm(left=left, right=right)}


# Falcon's FalconLinear computes input @ Wᵀ + b, nn.Linear's own formula written out (to avoid a fused kernel).
register_rule_by_name("transformers.models.falcon.modeling_falcon.FalconLinear")(LinearRule)
