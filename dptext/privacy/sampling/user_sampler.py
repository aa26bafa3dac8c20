"""User-level Poisson sampling (ULS, issue 24): the privacy unit is a user, all of whose examples may be in the data.

Each step every user joins independently with probability q (q over users, so the accountant's sampled Gaussian
mechanism holds with users in place of examples), and each sampled user contributes min(k, n_u) of its examples,
drawn uniformly without replacement. The draw of a user's k examples uses only the generator and n_u: it is
independent of the other users and of what the examples contain, so no content can steer which examples are seen.
The engine then clips each user's summed gradient to C (``engine.accumulate(loss, units=...)``), so adding or
removing one user moves the clipped sum by at most C.

The generator is the "sampler" child of the run's random root (never the noise's stream); like ``PoissonSampler``
the sampler's whole state is ``generator`` and ``steps``, which is what a checkpoint saves and a resume restores.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dptext.privacy.noise.randomness import RandomRoot, as_root


class UserBatch(NamedTuple):
    """One step's examples and, for each, the user (privacy unit) it belongs to: the ``units`` of accumulate."""

    indices: list[int]
    users: list[int]


def make_user_sampler(users: list[list[int]], sample_rate: float, steps: int, max_examples_per_user: int,
                      seed: int | RandomRoot | None) -> "UserPoissonSampler":
    """The user-level sampler drawing from the "sampler" child of ``seed``'s root (secret when ``seed`` is None)."""
    return UserPoissonSampler(users, sample_rate, steps, max_examples_per_user, as_root(seed).generator("sampler"))


class UserPoissonSampler:
    """``users[u]`` lists the example indices of user u; a user is unit u in every batch it joins."""

    def __init__(self, users: list[list[int]], sample_rate: float, steps: int, max_examples_per_user: int,
                 generator: torch.Generator):
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if max_examples_per_user < 1:
            raise ValueError(f"max_examples_per_user must be at least 1, got {max_examples_per_user}")
        seen = [index for examples in users for index in examples]
        if len(seen) != len(set(seen)):  # an example of two users would count twice: two units, 2C
            raise ValueError("an example belongs to more than one user; each example needs exactly one user")
        self.users = [list(examples) for examples in users]
        self.sample_rate = sample_rate
        self.steps = steps
        self.max_examples_per_user = max_examples_per_user
        self.generator = generator
        self.matches_accounting = True

    @property
    def num_users(self) -> int:
        return len(self.users)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for _ in range(self.steps):
            yield self._one_batch()

    def _one_batch(self) -> UserBatch:
        chosen = (torch.rand(self.num_users, generator=self.generator) < self.sample_rate).nonzero().flatten()
        indices: list[int] = []
        owners: list[int] = []
        for user in chosen.tolist():
            examples = self.users[user]
            # a uniform random permutation's first k: a uniform k-subset whose draw sees only n_u
            order = torch.randperm(len(examples), generator=self.generator)
            kept = order[:self.max_examples_per_user].sort().values.tolist()
            indices.extend(examples[position] for position in kept)
            owners.extend([user] * len(kept))
        return UserBatch(indices, owners)
