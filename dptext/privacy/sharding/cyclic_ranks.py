"""Cyclic balls-in-bins batches over several processes (matrix-factorization noise under FSDP2; docs/sharding.md).

The (k, P) participation schema is about the global bins: example i is in bin b_i, drawn once, and every step t
trains bin t mod P. So every rank draws the very same bins, from rank 0's "sampler" generator state (broadcast: a
secret root differs from rank to rank), and step t's logical batch is bin t mod P split over the ranks by index,
as the sharded DP-SGD path splits its data (example i on rank i mod N): each rank trains the members of the bin it
owns, and the union over the ranks is the bin. Each example is trained by one rank only, at the steps of its bin.
"""

from __future__ import annotations

from typing import Any

from dptext.privacy.noise.randomness import RandomRoot
from dptext.privacy.sampling.cyclic import CyclicBinSampler


class RankCyclicSampler(CyclicBinSampler):
    """``CyclicBinSampler``'s global bins; yields this rank's members (i mod N = rank) of each step's bin."""

    def __init__(self, dataset_size: int, bins: int, steps: int, generator: Any, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        super().__init__(dataset_size, bins, steps, generator)

    def __iter__(self):
        for members in super().__iter__():
            yield [i for i in members if i % self.world_size == self.rank]


def rank_cyclic_sampler(root: RandomRoot, context: Any, dataset_size: int, bins: int,
                        steps: int) -> RankCyclicSampler:
    """The sampler of this rank: the bins drawn from rank 0's "sampler" child, every rank alike."""
    generator = root.generator("sampler")
    generator.set_state(context.broadcast(generator.get_state()))
    return RankCyclicSampler(dataset_size, bins, steps, generator, context.rank, context.world_size)
