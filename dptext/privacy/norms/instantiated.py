"""Norms and clipped sums of per-example gradients that are small enough to form outright.

Normalisation layers have d-dimensional per-example gradients (SPEC §2: "instantiate them"), so their
rules form G_i and share these two reductions.
"""

from __future__ import annotations

import torch
from torch import Tensor


def norm_sq_of(per_example: dict[str, Tensor]) -> dict[str, Tensor]:
    return {name: grad.float().pow(2).flatten(1).sum(dim=1) for name, grad in per_example.items()}


def clipped_sum_of(per_example: dict[str, Tensor], coef: dict[str, Tensor]) -> dict[str, Tensor]:
    return {name: torch.tensordot(coef[name].to(grad.dtype), grad, dims=1) for name, grad in per_example.items()}
