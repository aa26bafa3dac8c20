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

import torch
from torch import Tensor, nn

from dptext.privacy.norms.outer import OuterForm
from dptext.privacy.norms.registry import register_rule, register_rule_by_name


def as_sequences(x: Tensor) -> Tensor:
    """(B, d) or (B, ..., d) → (B, T, d): every leading position of one example is a "token"."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


def use_ghost_form(positions: int, out_features: int, in_features: int) -> bool:
    return 2 * positions * positions < out_features * in_features


def ghost_norm_sq(a: Tensor, g: Tensor) -> Tensor:
    if a.shape[1] == 1:
        return a.float().pow(2).sum(dim=(1, 2)) * g.float().pow(2).sum(dim=(1, 2))
    a, g = a.float(), g.float()
    return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum(dim=(1, 2))


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
