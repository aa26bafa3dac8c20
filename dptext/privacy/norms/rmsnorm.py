"""RMSNorm: y_t = w ⊙ x̂_t with x̂_t = x_t / sqrt(mean(x_t²) + eps) (Llama, SmolLM2, T5, Mistral, torch).

Per example (SPEC §2): G_i^w = Σ_t x̂_t ⊙ g_t, d-dimensional, instantiated. The same gradient holds for the
(1 + w) ⊙ x̂ variant (Gemma). Besides the classes registered here, any module of that form, one 1-D
``weight`` and a ``variance_epsilon`` or ``eps``, is recognised structurally; ``verify`` then checks on a
random input that its forward really is one of those two formulas before the rule is trusted.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dptext.privacy.norms.instantiated import clipped_sum_of, norm_sq_of
from dptext.privacy.norms.layernorm import sum_over_positions
from dptext.privacy.norms.registry import register_rule

TORCH_RMSNORM = (nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()


def epsilon(module: nn.Module, dtype: torch.dtype) -> float:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return torch.finfo(dtype).eps if eps is None else float(eps)  # torch's RMSNorm: None means finfo.eps


def normalize(module: nn.Module, x: Tensor) -> Tensor:
    # Llama normalises in fp32 and casts back before the weight; keep that rounding, then work in fp32.
    x32 = x.float()
    normalized = x32 * (x32.pow(2).mean(dim=-1, keepdim=True) + epsilon(module, x.dtype)).rsqrt()
    return normalized.to(x.dtype).float()


@register_rule(*TORCH_RMSNORM)
class RMSNormRule:
    def matches(self, module: nn.Module) -> bool:
        params = dict(module.named_parameters(recurse=False))
        has_eps = hasattr(module, "variance_epsilon") or hasattr(module, "eps")
        return has_eps and list(params) == ["weight"] and params["weight"].ndim == 1

    def verify(self, module: nn.Module) -> bool:
        weight = module.weight
        with torch.no_grad(), torch.random.fork_rng(devices=[weight.device] if weight.is_cuda else []):
            torch.manual_seed(0)
            x = (torch.randn(2, 3, weight.shape[0]) + 0.5).to(device=weight.device, dtype=weight.dtype)
            try:
                y = module(x).float()
            except Exception:  # a module that needs other inputs is not an RMSNorm
                return False
            normalized = normalize(module, x)
            tolerance = dict(rtol=1e-3, atol=1e-5) if weight.dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
            return any(torch.allclose(y, scale * normalized, **tolerance)
                       for scale in (weight.float(), 1 + weight.float()))

    def keep(self, module: nn.Module, inputs: tuple) -> Tensor:
        return normalize(module, inputs[0])

    def per_example(self, module, names, normalized, grad_output) -> dict[str, Tensor]:
        return {"weight": sum_over_positions(normalized * grad_output.float(), normalized_ndim=1)}

    def norm_sq(self, module, names, normalized, grad_output) -> dict[str, Tensor]:
        return norm_sq_of(self.per_example(module, names, normalized, grad_output))

    def clipped_sum(self, module, names, normalized, grad_output, coef) -> dict[str, Tensor]:
        return clipped_sum_of(self.per_example(module, names, normalized, grad_output), coef)
