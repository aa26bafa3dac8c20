"""Correlated noise for banded matrix-factorization training (SPEC §12; accounting in dptext/accounting/banded_mf).

The mechanism releases C·G + Z for a b-banded lower-triangular Toeplitz strategy C with first column
(c_0, …, c_{b−1}); the model is trained on C⁻¹(C·G + Z) = G + C⁻¹Z, so step t's gradient sum gets w_t = (C⁻¹Z)_t
instead of DP-SGD's fresh z_t. Because C is banded, C·w = z is the recursion

    w_t = (z_t − Σ_{j=1}^{b−1} c_j · w_{t−j}) / c_0,

so only the last b − 1 noise vectors are kept (a ring buffer of b − 1 model-sized fp32 buffers per parameter)
and z_t is drawn exactly as DP-SGD draws it: one fresh N(0, σ²C²) per coordinate per step, from the engine's
secret noise stream (``NoiseSource``). Steps before the first are zero (w_{−j} = 0), which is C's own truncation.

``CorrelatedNoise`` is a drop-in ``NoiseSource`` for ``DPOptimizer``: its ``normals`` returns w_t for the
parameters asked, and it asks each parameter's noise exactly once per step (the optimizer's contract), so the
per-parameter history advances with the steps. Its state (generators and ring buffers) is checkpointed, so a
resume continues the same noise bit for bit.
"""

from __future__ import annotations

from collections import deque

import torch
from torch import Tensor, nn

from dptext.privacy.noise.optimizer import NoiseSource


class CorrelatedNoise:
    """w_t = C⁻¹z for the banded Toeplitz strategy ``coefficients``, z from ``source``; one history per parameter."""

    def __init__(self, source: NoiseSource, coefficients: list[float], params: list[nn.Parameter]):
        if not coefficients or coefficients[0] == 0:
            raise ValueError("a banded strategy needs c_0 ≠ 0")
        self.source = source
        self.coefficients = [float(c) for c in coefficients]
        self.params = list(params)
        self._index = {param: i for i, param in enumerate(self.params)}
        lags = len(self.coefficients) - 1
        self.history: list[deque] = [deque(maxlen=lags) for _ in self.params]  # newest first: w_{t−1}, w_{t−2}, …

    # what DPOptimizer and the engine use of a NoiseSource
    @property
    def secure(self) -> bool:
        return self.source.secure

    def generator(self, device: torch.device) -> torch.Generator:
        return self.source.generator(device)

    def reseed_if_secure(self) -> None:
        self.source.reseed_if_secure()

    def normal(self, std: float, like: Tensor) -> Tensor:
        return self.normals(std, [like])[0]

    def normals(self, std: float, likes: list[Tensor]) -> list[Tensor]:
        """This step's correlated noise for each of ``likes`` (the planned parameters); fresh tensors the caller
        may change in place."""
        fresh = self.source.normals(std, likes)
        out = []
        for like, z in zip(likes, fresh):
            if like not in self._index:
                raise ValueError("correlated noise is kept per planned parameter; this tensor is not one")
            past = self.history[self._index[like]]
            noise = z
            for c, w in zip(self.coefficients[1:], past):
                noise.sub_(w, alpha=c)
            noise.div_(self.coefficients[0])
            if past.maxlen:
                past.appendleft(noise.clone())
            out.append(noise)
        return out

    def state_dict(self) -> dict:
        return {"generators": self.source.state_dict(), "coefficients": list(self.coefficients),
                "history": [[w.cpu() for w in past] for past in self.history]}

    def load_state_dict(self, state: dict) -> None:
        if list(state["coefficients"]) != self.coefficients:
            raise ValueError("the checkpoint's correlated noise was drawn for another strategy")
        self.source.load_state_dict(state["generators"])
        for param, past, saved in zip(self.params, self.history, state["history"]):
            past.clear()
            past.extend(w.to(param.device) for w in saved)
