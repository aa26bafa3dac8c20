"""peft DoRA's magnitude vector (``DoraLinearLayer.weight``, one entry per output feature).

DoRA adds to the base output y⁰ = W a (bias excluded) the term (s − 1) ⊙ y⁰ + s ⊙ κ·B A a with
s = m / ‖W + κBA‖ (row norms, detached from the graph as the DoRA paper and peft do). So
∂output_t/∂m = (y⁰_t + κ·B A a_t) / ‖W + κBA‖ and the per-example gradient is G_i = Σ_t h_t ⊙ g_t
with h_t that factor: d-dimensional, instantiated like a norm layer's weight (SPEC §2). The A and B matrices are
ordinary Linear layers with their own rules; the weight norm is computed from detached weights, so it opens no path of
its own.
``keep_call`` recomputes h from the layer's keyword arguments (peft passes lora_A, lora_B, scaling, base_layer
and possibly base_result as keywords); only a plain 2-D base weight and bias-free A, B Linear layers are handled.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from dptext.errors import UserError
from dptext.privacy.norms.instantiated import clipped_sum_of, norm_sq_of
from dptext.privacy.norms.layernorm import sum_over_positions
from dptext.privacy.norms.registry import register_rule_by_name


@register_rule_by_name("peft.tuners.lora.dora.DoraLinearLayer")
class DoraMagnitudeRule:
    def keep_call(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor:
        x = args[0] if args else kwargs["x"]
        lora_A, lora_B, base = kwargs["lora_A"], kwargs["lora_B"], kwargs["base_layer"]
        if not (type(lora_A) is nn.Linear and type(lora_B) is nn.Linear and lora_A.bias is None
                and lora_B.bias is None and base.weight.ndim == 2 and base.weight.is_floating_point()):
            raise UserError(f"DoRA on {type(base).__name__} (quantised or non-Linear base layer, or adapters with "
                            "a bias) has no per-example rule; use plain LoRA (use_dora=False) for it.")
        weight = base.weight.to(x.dtype)
        weight = weight.T if module.fan_in_fan_out else weight  # (out, in) as F.linear takes it
        lora_weight = lora_B.weight.to(x.dtype) @ lora_A.weight.to(x.dtype)
        weight_norm = (weight + kwargs["scaling"] * lora_weight).norm(dim=1)
        base_result = kwargs.get("base_result")
        if base_result is None:
            base_result = F.linear(x, weight)
        elif base.bias is not None:
            base_result = base_result - base.bias
        lora_result = F.linear(F.linear(x, lora_A.weight.to(x.dtype)), lora_B.weight.to(x.dtype))
        return (base_result + kwargs["scaling"] * lora_result) / weight_norm

    def per_example(self, module, names, factor, grad_output) -> dict[str, Tensor]:
        return {"weight": sum_over_positions(factor * grad_output, normalized_ndim=1)}

    def norm_sq(self, module, names, factor, grad_output) -> dict[str, Tensor]:
        return norm_sq_of(self.per_example(module, names, factor, grad_output))

    def clipped_sum(self, module, names, factor, grad_output, coef) -> dict[str, Tensor]:
        return clipped_sum_of(self.per_example(module, names, factor, grad_output), coef)
