"""Cyclic balls-in-bins batches: the participation schema matrix-factorization training (banded, BLT) is accounted
for.

Each example is put in one of P bins by its own independent uniform draw (from the engine's secret "sampler"
stream), once, before the first step; step t trains on bin t mod P. So every example takes part in at most
k = ⌈S/P⌉ of the S steps, any two of them exactly P apart: (k, P)-participation (Choquette-Choo et al. 2023),
the schema ``dptext.accounting.banded_mf.sensitivity`` and ``blt.blt_sensitivity`` are computed for. Bins are
drawn per example, never from its position among the others: adding or removing one example leaves every other
example's bin distribution unchanged, so a neighbouring dataset differs only in that example's own pattern
(add/remove adjacency). The batch size varies (binomial, mean n/P); the noisy sum is divided by the expected
n/P, never the realised size. No amplification by the secrecy of the bins is claimed: the bound holds for every
pattern.
"""

from __future__ import annotations

import math

import torch

from dptext.accounting.banded_mf import Participation
from dptext.errors import UserError


class CyclicBinSampler:
    """``steps`` batches over ``dataset_size`` examples in ``bins`` bins drawn from ``generator``."""

    def __init__(self, dataset_size: int, bins: int, steps: int, generator: torch.Generator):
        if bins < 1 or steps < 1 or dataset_size < 1:
            raise UserError(f"Cyclic sampling needs ≥ 1 example, bin and step (got n={dataset_size}, "
                            f"bins={bins}, steps={steps}).")
        self.dataset_size = dataset_size
        self.bins = bins
        self.total_steps = steps
        self.steps = steps  # still to run: a resumed loop sets it to total − done, and the cycle continues there
        self.matches_accounting = True
        self._torch_generator = generator
        self.generator = _BinDraw(self)  # what a checkpoint saves: the state the bins were drawn from
        self.generator.set_state(generator.get_state())

    @property
    def schema(self) -> Participation:
        """The participation this sampler can produce: at most ⌈S/P⌉ steps per example, P apart."""
        return Participation(math.ceil(self.total_steps / self.bins), self.bins)

    @property
    def expected_batch_size(self) -> float:
        return self.dataset_size / self.bins

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        members = [(self.bin_of == b).nonzero().flatten().tolist() for b in range(self.bins)]
        for step in range(self.total_steps - self.steps, self.total_steps):
            yield members[step % self.bins]


class _BinDraw:
    """The sampler's randomness as the training loop checkpoints it (``get_state``/``set_state``): the generator
    state the bins were drawn from, so a resumed run re-draws the very same bins instead of new ones (new bins
    would put an example in two steps less than P apart)."""

    def __init__(self, sampler: CyclicBinSampler):
        self.sampler = sampler
        self.state: torch.Tensor | None = None

    def get_state(self) -> torch.Tensor:
        return self.state.clone()

    def set_state(self, state: torch.Tensor) -> None:
        self.state = state.clone()
        generator = self.sampler._torch_generator
        generator.set_state(self.state)
        self.sampler.bin_of = torch.randint(0, self.sampler.bins, (self.sampler.dataset_size,), generator=generator)
