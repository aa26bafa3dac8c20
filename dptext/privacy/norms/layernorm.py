"""nn.LayerNorm: y_t = w ⊙ x̂_t + b with x̂_t = (x_t − mean(x_t)) / sqrt(var(x_t) + eps).

Per example (SPEC §2): G_i^w = Σ_t x̂_t ⊙ g_t and G_i^b = Σ_t g_t, both of the normalised shape, so they are
instantiated. The forward hook keeps x̂ (recomputed in fp32 from the input) instead of the input.
"""

from __future__ import annotations

from torch import Tensor, nn

from dptext.privacy.norms.instantiated import clipped_sum_of, norm_sq_of
from dptext.privacy.norms.registry import register_rule


def positions_dims(grad_output: Tensor, normalized_ndim: int) -> tuple[int, ...]:
    """The dimensions between the batch and the normalised ones: the positions summed over."""
    return tuple(range(1, grad_output.ndim - normalized_ndim))


@register_rule(nn.LayerNorm)
class LayerNormRule:
    def keep(self, module: nn.LayerNorm, inputs: tuple) -> Tensor:
        x = inputs[0].float()
        dims = tuple(range(x.ndim - len(module.normalized_shape), x.ndim))
        mean = x.mean(dim=dims, keepdim=True)
        variance = x.var(dim=dims, keepdim=True, unbiased=False)
        return (x - mean) * (variance + module.eps).rsqrt()

    def per_example(self, module, names, normalized, grad_output) -> dict[str, Tensor]:
        summed_over = positions_dims(grad_output, len(module.normalized_shape))
        grads = {}
        if "weight" in names:
            grads["weight"] = (normalized * grad_output.float()).sum(dim=summed_over)
        if "bias" in names:
            grads["bias"] = grad_output.float().sum(dim=summed_over)
        return grads

    def norm_sq(self, module, names, normalized, grad_output) -> dict[str, Tensor]:
        return norm_sq_of(self.per_example(module, names, normalized, grad_output))

    def clipped_sum(self, module, names, normalized, grad_output, coef) -> dict[str, Tensor]:
        return clipped_sum_of(self.per_example(module, names, normalized, grad_output), coef)
