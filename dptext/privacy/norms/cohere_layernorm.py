"""Cohere's ``CohereLayerNorm``: y_t = w ⊙ x̂_t with x̂_t = (x_t − mean(x_t)) / sqrt(var(x_t) + eps), no bias.

It normalises over the last dimension only, also when its weight is 2-D (the per-head QK norm: weight of shape
(heads, head_dim) against inputs (..., heads, head_dim)), and computes in fp32. The per-example gradient is
G_i = Σ_t x̂_t ⊙ g_t summed over every position before the weight's dimensions, the shape of the weight:
instantiated like LayerNorm's (SPEC §2).
"""

from __future__ import annotations

from torch import Tensor, nn

from dptext.privacy.norms.instantiated import clipped_sum_of, norm_sq_of
from dptext.privacy.norms.layernorm import sum_over_positions
from dptext.privacy.norms.registry import register_rule_by_name


@register_rule_by_name("transformers.models.cohere.modeling_cohere.CohereLayerNorm")
class CohereLayerNormRule:
    def keep(self, module: nn.Module, inputs: tuple) -> Tensor:
        x = inputs[0].float()
        centred = x - x.mean(dim=-1, keepdim=True)
        return centred * (centred.pow(2).mean(dim=-1, keepdim=True) + module.variance_epsilon).rsqrt()

    def per_example(self, module, names, normalized, grad_output) -> dict[str, Tensor]:
        return {"weight": sum_over_positions(normalized * grad_output.float(), module.weight.ndim)}

    def norm_sq(self, module, names, normalized, grad_output) -> dict[str, Tensor]:
        return norm_sq_of(self.per_example(module, names, normalized, grad_output))

    def clipped_sum(self, module, names, normalized, grad_output, coef) -> dict[str, Tensor]:
        return clipped_sum_of(self.per_example(module, names, normalized, grad_output), coef)
