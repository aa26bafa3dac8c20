"""nn.LayerNorm: y_t = w ⊙ x̂_t + b with x̂_t = (x_t − mean(x_t)) / sqrt(var(x_t) + eps).

Per example (SPEC §2): G_i^w = Σ_t x̂_t ⊙ g_t and G_i^b = Σ_t g_t, both of the normalised shape, so they are
instantiated. The forward hook keeps x̂ (recomputed in fp32 from the input) instead of the input.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn import functional as F

from dptext.privacy.norms.instantiated import clipped_sum_of, norm_sq_of
from dptext.privacy.norms.registry import register_rule


def sum_over_positions(x: Tensor, normalized_ndim: int) -> Tensor:
    """Sum the dimensions between the batch and the normalised ones (none for a (B, d) input)."""
    positions = tuple(range(1, x.ndim - normalized_ndim))
    return x.sum(dim=positions) if positions else x  # sum(dim=()) would sum everything


@register_rule(nn.LayerNorm)
class LayerNormRule:
    def keep(self, module: nn.LayerNorm, inputs: tuple) -> Tensor:
        # layer_norm without weight and bias is x̂ itself: one fused kernel, ~8× faster on CPU than mean, var,
        # subtract and scale written out (measured, B=8, T=128, d=384), and the same biased variance
        return F.layer_norm(inputs[0].float(), module.normalized_shape, None, None, module.eps)

    def per_example(self, module, names, normalized, grad_output) -> dict[str, Tensor]:
        normalized_ndim = len(module.normalized_shape)
        grads = {}
        if "weight" in names:
            grads["weight"] = sum_over_positions(normalized * grad_output.float(), normalized_ndim)
        if "bias" in names:
            grads["bias"] = sum_over_positions(grad_output.float(), normalized_ndim)
        return grads

    def norm_sq(self, module, names, normalized, grad_output) -> dict[str, Tensor]:
        return norm_sq_of(self.per_example(module, names, normalized, grad_output))

    def clipped_sum(self, module, names, normalized, grad_output, coef) -> dict[str, Tensor]:
        return clipped_sum_of(self.per_example(module, names, normalized, grad_output), coef)
