"""Batch samplers over a dataset of n examples, yielding lists of example indices.

* ``PoissonSampler``: each example joins each batch independently with probability q (SPEC §1). Batch sizes
  vary and may be 0; this is the sampling the accountant (sampled Gaussian mechanism) assumes.
* ``ShuffleSampler``: a random permutation cut into batches of fixed size ⌊qn⌋ (epochs of disjoint batches),
  what most training loops do. Its privacy is NOT what the Poisson accountant reports, so a private engine
  refuses it (fail closed); it exists for non-private baselines and comparisons, and warns when built.
"""

from __future__ import annotations

import math
import warnings

import torch

from dptext.privacy.noise.randomness import RandomRoot, as_root


def make_sampler(dataset_size: int, sample_rate: float, steps: int, seed: int | RandomRoot | None,
                 sampling: str = "poisson", distributed=None, shard: list[int] | None = None):
    """The sampler an engine is accounted for, drawing from the "sampler" child of ``seed``'s root (a secret
    root when ``seed`` is None; never the noise's stream). With a distributed context of N > 1 processes:
    Poisson sampling of this rank's shard (``shard``, or the context's index shard), from its own stream."""
    root = as_root(seed)
    if distributed is not None and distributed.active:
        generator = root.generator("sampler", rank=distributed.rank)
        own = distributed.shard(dataset_size) if shard is None else shard
        return PoissonSampler(dataset_size, sample_rate, steps, generator, shard=own)
    generator = root.generator("sampler")
    if sampling == "poisson":
        return PoissonSampler(dataset_size, sample_rate, steps, generator, shard=shard)
    return ShuffleSampler(dataset_size, sample_rate, steps, generator)


SHUFFLE_WARNING = ("shuffle sampling does not match the Poisson-subsampling privacy accounting: the ε "
                   "reported for this run is not a proven guarantee; use sampling='poisson' for private runs")


class PoissonSampler:
    """``shard``: sample only these indices (one rank's share of a distributed run), each with rate q."""

    def __init__(self, dataset_size: int, sample_rate: float, steps: int, generator: torch.Generator,
                 shard: list[int] | None = None):
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self.dataset_size = dataset_size
        self.sample_rate = sample_rate
        self.steps = steps
        self.generator = generator
        self.matches_accounting = True
        self.shard = None if shard is None else torch.tensor(shard, dtype=torch.long)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for _ in range(self.steps):
            if self.shard is not None:
                yield self.shard[torch.rand(len(self.shard), generator=self.generator) < self.sample_rate].tolist()
                continue
            chosen = torch.rand(self.dataset_size, generator=self.generator) < self.sample_rate
            yield chosen.nonzero().flatten().tolist()


class ShuffleSampler:
    def __init__(self, dataset_size: int, sample_rate: float, steps: int, generator: torch.Generator):
        warnings.warn(SHUFFLE_WARNING, stacklevel=2)
        self.dataset_size = dataset_size
        self.sample_rate = sample_rate
        self.batch_size = max(1, int(sample_rate * dataset_size))
        self.steps = steps
        self.generator = generator
        self.matches_accounting = False

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        batches_per_epoch = math.ceil(self.dataset_size / self.batch_size)
        order: list[int] = []
        for step in range(self.steps):
            if step % batches_per_epoch == 0:
                order = torch.randperm(self.dataset_size, generator=self.generator).tolist()
            start = (step % batches_per_epoch) * self.batch_size
            yield order[start:start + self.batch_size]
