"""User-level Poisson sampling: users join at rate q, at most k examples each, chosen blind to the content."""

from __future__ import annotations

import math

import pytest
import torch

from dptext.privacy.noise.randomness import RandomRoot
from dptext.privacy.sampling.user_sampler import UserPoissonSampler, make_user_sampler


def sizes_of(users: int, seed: int = 0) -> list[list[int]]:
    """Users with 1 to 12 examples each, indices numbered in order."""
    counts = torch.randint(1, 13, (users,), generator=torch.Generator().manual_seed(seed)).tolist()
    starts = [sum(counts[:u]) for u in range(users)]
    return [list(range(start, start + n)) for start, n in zip(starts, counts)]


def test_each_user_joins_at_rate_q_and_each_example_at_rate_k_over_n():
    users, q, steps, k = sizes_of(200), 0.05, 600, 3
    joined = torch.zeros(len(users))
    example_hits = torch.zeros(sum(len(u) for u in users))
    for batch in UserPoissonSampler(users, q, steps, k, torch.Generator().manual_seed(1)):
        joined[sorted(set(batch.users))] += 1
        example_hits[batch.indices] += 1
    rate = joined / steps  # per user ~ Binomial(steps, q)/steps
    assert abs(float(rate.mean()) - q) < 4 * math.sqrt(q * (1 - q) / (steps * len(users)))
    # a user with n examples shows each one with probability q·min(1, k/n)
    big = [u for u in range(len(users)) if len(users[u]) >= 9]
    observed = sum(float(example_hits[users[u]].sum()) for u in big)
    expected = sum(q * steps * min(len(users[u]), k) for u in big)
    assert abs(observed - expected) < 4 * math.sqrt(expected)


def test_at_most_k_distinct_examples_per_user_each_with_its_own_id():
    users, k = sizes_of(50, seed=2), 4
    owner = {index: u for u, examples in enumerate(users) for index in examples}
    for batch in UserPoissonSampler(users, 0.3, 50, k, torch.Generator().manual_seed(3)):
        assert len(batch.indices) == len(batch.users) == len(set(batch.indices))
        for index, user in zip(batch.indices, batch.users):
            assert owner[index] == user
        for user in set(batch.users):
            assert batch.users.count(user) == min(k, len(users[user]))


def test_which_k_examples_are_drawn_does_not_depend_on_the_content():
    # two datasets with the same users' sizes but different example indices (content): the same positions within
    # each user are drawn, so nothing in the examples can steer the choice
    users = sizes_of(40, seed=4)
    total = sum(len(u) for u in users)
    relabel = torch.randperm(total, generator=torch.Generator().manual_seed(5)).tolist()
    other = [[relabel[i] for i in examples] for examples in users]
    first = UserPoissonSampler(users, 0.4, 20, 3, torch.Generator().manual_seed(6))
    second = UserPoissonSampler(other, 0.4, 20, 3, torch.Generator().manual_seed(6))
    for a, b in zip(first, second):
        assert a.users == b.users
        assert [relabel[i] for i in a.indices] == b.indices


def test_resume_from_the_generator_state_is_bit_exact():
    users = sizes_of(60, seed=7)
    whole = list(make_user_sampler(users, 0.2, 10, 2, RandomRoot(11)))
    sampler = make_user_sampler(users, 0.2, 10, 2, RandomRoot(11))
    batches = iter(sampler)
    head = [next(batches) for _ in range(4)]
    state = sampler.generator.get_state()
    resumed = make_user_sampler(users, 0.2, 10, 2, RandomRoot(999))  # a fresh run, then restored as loop.restore does
    resumed.generator.set_state(state)
    resumed.steps = 10 - 4
    assert head + list(resumed) == whole


def test_sampler_stream_is_not_the_noise_stream_and_bad_settings_are_refused():
    root = RandomRoot(3)
    assert make_user_sampler([[0]], 0.5, 1, 1, root).generator.initial_seed() != \
        root.generator("noise").initial_seed()
    with pytest.raises(ValueError, match="more than one user"):
        UserPoissonSampler([[0, 1], [1]], 0.5, 1, 1, torch.Generator())
    with pytest.raises(ValueError, match="max_examples_per_user"):
        UserPoissonSampler([[0]], 0.5, 1, 0, torch.Generator())
