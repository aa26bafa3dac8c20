"""Samplers: Poisson batches have mean qn and variance nq(1−q); shuffle warns that it is not what is accounted."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dptext.privacy import PoissonSampler, PrivacyEngine, ShuffleSampler
from dptext.privacy.sampling.sampler import SHUFFLE_WARNING


def test_poisson_batches_have_mean_qn_and_binomial_spread():
    n, q, steps = 2000, 0.03, 400
    sizes = torch.tensor([len(b) for b in PoissonSampler(n, q, steps, torch.Generator().manual_seed(0))],
                         dtype=torch.float64)
    std = math.sqrt(n * q * (1 - q))
    assert abs(float(sizes.mean()) - n * q) < 4 * std / math.sqrt(steps)
    assert abs(float(sizes.std()) / std - 1) < 0.15
    assert len(set(sizes.tolist())) > 10  # the batch size really varies


def test_poisson_batches_can_be_empty_and_hold_distinct_valid_indices():
    batches = list(PoissonSampler(50, 0.01, 200, torch.Generator().manual_seed(1)))
    assert any(len(b) == 0 for b in batches)
    for batch in batches:
        assert len(set(batch)) == len(batch) and all(0 <= i < 50 for i in batch)


def test_shuffle_sampler_warns_and_covers_each_epoch_once():
    with pytest.warns(UserWarning, match="does not match the Poisson"):
        sampler = ShuffleSampler(10, 0.3, 4, torch.Generator().manual_seed(0))
    batches = list(sampler)
    assert [len(b) for b in batches] == [3, 3, 3, 1]
    assert sorted(sum(batches, [])) == list(range(10))
    assert "not a proven guarantee" in SHUFFLE_WARNING


def test_engine_sampler_is_the_accounted_one():
    model = nn.Linear(2, 2)
    engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                           max_grad_norm=1.0, expected_batch_size=20, dataset_size=1000, seed=5, verify=False)
    sampler = engine.sampler(steps=3)
    assert isinstance(sampler, PoissonSampler) and sampler.sample_rate == engine.sample_rate == 0.02
    assert len(list(sampler)) == 3
    assert engine.accounting() == {"sample_rate": 0.02, "noise_multiplier": 1.0, "steps": 0,
                                   "sampling": "poisson", "matches_accounting": True}
