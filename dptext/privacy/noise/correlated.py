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

Under FSDP2 (``privacy/sharding/sharded.py``) the source is the keyed ``ShardedNoise`` and the optimizer asks each
parameter's noise for the rows its rank owns (``rows``): z_t of those coordinates is the one-process draw, the
filter is linear and per coordinate, so w_t is too, and the state kept is that of the rank's rows only (≈ 1/N).
That state is then saved by every rank into the sharded checkpoint (``sharding/sharded_filter.py``), not here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque

import torch
from torch import Tensor, nn

from dptext.privacy.noise.optimizer import NoiseSource


class FilteredNoise(ABC):
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

    def rows(self, std: float, param: nn.Parameter, name: str, size: int, start: int, count: int,
             device: torch.device) -> Tensor:
        """Sharded: this step's correlated noise of flat coordinates [start, start + count) of ``param``, the rows
        this rank owns (the same ones at every step), filtered from the keyed draw of those coordinates."""
        if param not in self._index:
            raise ValueError("correlated noise is kept per planned parameter; this tensor is not one")
        return self._filter(self._index[param], self.source.normal(std, name, size, start, count, device))

    @property
    def step(self) -> int:  # the keyed source's step count (sharded), which the optimizer advances
        return self.source.step

    @step.setter
    def step(self, value: int) -> None:
        self.source.step = value

    @property
    def sharded(self) -> bool:
        return hasattr(self.source, "block_seed")

    @abstractmethod
    def _filter(self, index: int, z: Tensor) -> Tensor:
        """This step's noise of parameter ``index`` from its fresh draws ``z`` (the mechanism's filter)."""

    @abstractmethod
    def kept(self, index: int) -> list[Tensor]:
        """The filter state of parameter ``index``: the tensors a resume needs, in order."""

    @abstractmethod
    def keep(self, index: int, tensors: list[Tensor]) -> None:
        """Restore the filter state of parameter ``index`` (``kept``'s tensors)."""

    def state_dict(self) -> dict:
        if self.sharded:  # the tensors are each rank's own rows: they go to the sharded checkpoint instead
            return {"generators": self.source.state_dict(), **self._filter_state(), "sharded": True}
        return {"generators": self.source.state_dict(), **self._filter_state(),
                # copies: the buffers change in place at every step, and a saved state must not change with them
                "kept": [[t.to("cpu", copy=True) for t in self.kept(i)] for i in range(len(self.params))]}

    def load_state_dict(self, state: dict) -> None:
        self._load_filter_state(state)
        if self.sharded != bool(state.get("sharded")):
            raise ValueError("the checkpoint's correlated noise was kept under another sharding")
        if not self.sharded:  # a sharded state was put back from the sharded checkpoint, before this
            # "history" (banded MF) and "buffers" (BLT): the same per-parameter lists, as checkpoints before 90b40dd
            # named them
            kept = next((state[key] for key in ("kept", "history", "buffers") if key in state), None)
            if kept is None or len(kept) != len(self.params):
                raise ValueError("the checkpoint holds no correlated-noise state for this run's parameters")
            for i, (param, saved) in enumerate(zip(self.params, kept)):
                self.keep(i, [t.to(param.device, copy=True) for t in saved])
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

    def kept(self, index: int) -> list[Tensor]:
        return list(self.history[index])

    def keep(self, index: int, tensors: list[Tensor]) -> None:
        self.history[index].clear()
        self.history[index].extend(tensors)

    def _filter_state(self) -> dict:
        return {"coefficients": list(self.coefficients)}

    def _load_filter_state(self, state: dict) -> None:
        if list(state["coefficients"]) != self.coefficients:
            raise ValueError("the checkpoint's correlated noise was drawn for another strategy")


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

    def kept(self, index: int) -> list[Tensor]:
        return list(self.buffers[index])

    def keep(self, index: int, tensors: list[Tensor]) -> None:
        self.buffers[index][:] = tensors

    def _filter_state(self) -> dict:
        return {"blt": list(self.strategy)}

    def _load_filter_state(self, state: dict) -> None:
        if list(state["blt"]) != self.strategy:
            raise ValueError("the checkpoint's BLT noise was drawn for another strategy")
