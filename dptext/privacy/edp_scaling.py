"""eDP-SGD's per-tensor scaling α (``dptext.privacy.edp``): the choices and α measured from a gradient."""

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
