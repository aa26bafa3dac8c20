"""Correlated noise for matrix-factorization training: banded and BLT strategies (SPEC §12; accounting in
dptext/accounting/banded_mf.py and blt.py).

The mechanism releases C·G + Z for a b-banded lower-triangular Toeplitz strategy C with first column
(c_0, …, c_{b−1}); the model is trained on C⁻¹(C·G + Z) = G + C⁻¹Z, so step t's gradient sum gets w_t = (C⁻¹Z)_t
instead of DP-SGD's fresh z_t. Because C is banded, C·w = z is the recursion

    w_t = (z_t − Σ_{j=1}^{b−1} c_j · w_{t−j}) / c_0,

so only the last b − 1 noise vectors are kept (a ring buffer of b − 1 model-sized fp32 buffers per parameter)
and z_t is drawn exactly as DP-SGD draws it: one fresh N(0, σ²C²) per coordinate per step, from the engine's
secret noise stream (``NoiseSource``). Steps before the first are zero (w_{−j} = 0), which is C's own truncation.

A BLT strategy (``BufferedNoise``) solves C·w = z with d decaying buffers instead of a ring of past draws:
w_t = (z_t − Σ_i ω_i s_i) / c_0, then s_i ← θ_i s_i + w_t, whatever the run's length.

Both are drop-in ``NoiseSource``s for ``DPOptimizer`` (``FilteredNoise``): ``normals`` returns w_t for the
parameters asked, and the optimizer asks each parameter's noise exactly once per step (its contract), so the
per-parameter state advances with the steps. That state (generators and buffers) is checkpointed, so a resume
continues the same noise bit for bit.
"""

from __future__ import annotations

from collections import deque

import torch
from torch import Tensor, nn

from dptext.privacy.noise.optimizer import NoiseSource


class FilteredNoise:
    """A ``NoiseSource`` whose fresh draws z_t pass, per planned parameter, through a causal filter: w_t = (C⁻¹z)_t.

    Subclasses keep each parameter's filter state (``_filter``) and say how to save and restore it."""

    def __init__(self, source: NoiseSource, params: list[nn.Parameter]):
        self.source = source
        self.params = list(params)
        self._index = {param: i for i, param in enumerate(self.params)}

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
        out = []
        for like, z in zip(likes, self.source.normals(std, likes)):
            if like not in self._index:
                raise ValueError("correlated noise is kept per planned parameter; this tensor is not one")
            out.append(self._filter(self._index[like], z))
        return out

    def _filter(self, index: int, z: Tensor) -> Tensor:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"generators": self.source.state_dict(), **self._filter_state()}

    def load_state_dict(self, state: dict) -> None:
        self._load_filter_state(state)
        self.source.load_state_dict(state["generators"])


class CorrelatedNoise(FilteredNoise):
    """w_t = C⁻¹z for the banded Toeplitz strategy ``coefficients``, z from ``source``; one history per parameter."""

    def __init__(self, source: NoiseSource, coefficients: list[float], params: list[nn.Parameter]):
        if not coefficients or coefficients[0] == 0:
            raise ValueError("a banded strategy needs c_0 ≠ 0")
        super().__init__(source, params)
        self.coefficients = [float(c) for c in coefficients]
        lags = len(self.coefficients) - 1
        self.history: list[deque] = [deque(maxlen=lags) for _ in self.params]  # newest first: w_{t−1}, w_{t−2}, …

    def _filter(self, index: int, z: Tensor) -> Tensor:
        past = self.history[index]
        noise = z
        for c, w in zip(self.coefficients[1:], past):
            noise.sub_(w, alpha=c)
        noise.div_(self.coefficients[0])
        if past.maxlen:
            past.appendleft(noise.clone())
        return noise

    def _filter_state(self) -> dict:
        return {"coefficients": list(self.coefficients), "history": [[w.cpu() for w in past] for past in self.history]}

    def _load_filter_state(self, state: dict) -> None:
        if list(state["coefficients"]) != self.coefficients:
            raise ValueError("the checkpoint's correlated noise was drawn for another strategy")
        for param, past, saved in zip(self.params, self.history, state["history"]):
            past.clear()
            past.extend(w.to(param.device) for w in saved)


class BufferedNoise(FilteredNoise):
    """w_t = C⁻¹z for the BLT strategy (c_0, ω, θ) (``accounting/blt.py``): d decaying buffers per parameter,

        w_t = (z_t − Σ_i ω_i s_i) / c_0,   then   s_i ← θ_i s_i + w_t,

    with s_i = 0 before the first step (so the first step's buffers are w_0 itself)."""

    def __init__(self, source: NoiseSource, c0: float, omega: list[float], theta: list[float],
                 params: list[nn.Parameter]):
        if c0 == 0 or not omega or len(omega) != len(theta):
            raise ValueError("a BLT strategy needs c_0 ≠ 0 and as many ω as θ")
        super().__init__(source, params)
        self.strategy = [float(c0), [float(w) for w in omega], [float(t) for t in theta]]
        self.buffers: list[list[Tensor]] = [[] for _ in self.params]  # s_i per parameter, empty before step 0

    def _filter(self, index: int, z: Tensor) -> Tensor:
        c0, omega, theta = self.strategy
        buffers = self.buffers[index]
        noise = z
        for w, s in zip(omega, buffers):
            noise.sub_(s, alpha=w)
        noise.div_(c0)
        if not buffers:
            buffers.extend(noise.clone() for _ in theta)
        else:
            for t, s in zip(theta, buffers):
                torch.add(noise, s, alpha=t, out=s)  # s ← θ·s + w in one pass over the buffer
        return noise

    def _filter_state(self) -> dict:
        # copies: the buffers change in place at every step, and a saved state must not change with them
        saved = [[s.to("cpu", copy=True) for s in kept] for kept in self.buffers]
        return {"blt": list(self.strategy), "buffers": saved}

    def _load_filter_state(self, state: dict) -> None:
        if list(state["blt"]) != self.strategy:
            raise ValueError("the checkpoint's BLT noise was drawn for another strategy")
        for param, kept, saved in zip(self.params, self.buffers, state["buffers"]):
            kept[:] = [s.to(param.device, copy=True) for s in saved]
