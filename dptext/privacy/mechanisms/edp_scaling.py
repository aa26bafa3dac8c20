"""eDP-SGD's per-tensor scaling α (``dptext.privacy.mechanisms.edp``): the choices and α measured from a gradient."""

from __future__ import annotations

import math

from torch import Tensor, nn

from dptext.errors import UserError

SCALINGS = ("uniform", "public", "first_step")
ALPHA_FLOOR = 1e-3


def alphas_from_gradients(grads: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, float]:
    """α_l ∝ ‖grad_l‖, normalised to root-mean-square 1 over the parameter tensors, floored at ALPHA_FLOOR."""
    norms = {param: float(grad.float().norm()) for param, grad in grads.items()}
    rms = math.sqrt(sum(n * n for n in norms.values()) / max(len(norms), 1))
    if not rms > 0 or not math.isfinite(rms):
        raise UserError("The gradient that sets eDP-SGD's scaling α is zero or not finite; use more (or other) "
                        "examples for it, or privacy.edp_scaling=uniform.")
    return {param: max(n / rms, ALPHA_FLOOR) for param, n in norms.items()}


def check_alphas(alphas: dict[nn.Parameter, float] | None, scaling: str) -> None:
    """α must be positive and finite (0, NaN or ∞ turn the clip or the noise into NaN/∞), and measured α are not
    'uniform'."""
    if alphas is None:
        return
    values = [float(a) for a in alphas.values()]
    if any(not (math.isfinite(a) and a > 0) for a in values):
        raise UserError("eDP-SGD's scaling α must be positive finite numbers, one per parameter tensor.")
    if scaling == "uniform" and any(a != 1.0 for a in values):
        raise UserError("scaling='uniform' means α = 1; for measured α say where they were measured: "
                        "scaling='public' (public examples) or 'first_step' (private: not covered by ε).")
