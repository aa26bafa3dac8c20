"""One root of randomness with named children (issue 21 points 1–2): the noise of a step must not give away
which examples its Poisson batch holds, and noise is secret unless reproducibility is asked for."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from dptext.errors import UserError
from dptext.privacy import PrivacyEngine
from dptext.privacy.noise.randomness import CHILDREN, RandomRoot

N, Q, SIGMA, C = 400, 0.05, 2.0, 1.0


def uniforms_from_noise(noise: torch.Tensor, std: float, count: int) -> torch.Tensor:
    """Invert torch's CPU Box–Muller (blocks of 16: radius from the first 8 uniforms, angle from the next 8):
    the uniforms the noise generator consumed. If the sampler shares that stream, these decide inclusion."""
    z = (noise / std).double()
    u = torch.empty(len(z) // 16 * 16, dtype=torch.float64)
    for start in range(0, len(u), 16):
        a, b = z[start:start + 8], z[start + 8:start + 16]
        u[start:start + 8] = 1 - torch.exp(-(a * a + b * b) / 2)
        u[start + 8:start + 16] = (torch.atan2(b, a) / (2 * math.pi)) % 1.0
    return u[:count]


def test_the_attack_works_when_sampler_and_noise_share_a_stream():
    """The control: with one seed for both (the old default), the noise reveals the batch exactly."""
    chosen = (torch.rand(N, generator=torch.Generator().manual_seed(0)) < Q).nonzero().flatten()
    noise = torch.empty(2000).normal_(0, SIGMA * C, generator=torch.Generator().manual_seed(0))
    guess = (uniforms_from_noise(noise, SIGMA * C, N) < Q).nonzero().flatten()
    assert torch.equal(chosen, guess)


def noise_and_batch(**engine_kwargs):
    """Through the public API: one sampled batch, one step with nothing accumulated, the noise off the weights."""
    torch.manual_seed(0)
    model = nn.Linear(50, 40, bias=False)  # 2000 noise coordinates, more than the N uniforms the sampler uses
    before = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    engine = PrivacyEngine(model, optimizer, noise_multiplier=SIGMA, max_grad_norm=C, sample_rate=Q,
                           dataset_size=N, **engine_kwargs, verify=False)
    sampler = engine.sampler(steps=1)
    uniforms = torch.rand(N, generator=copy.deepcopy(sampler.generator))  # what the sampler is about to draw
    batch = next(iter(sampler))
    assert batch == (uniforms < Q).nonzero().flatten().tolist()
    engine.step()  # empty accumulation: the update is noise / B
    noise = (before - model.weight.detach()).flatten() * engine.expected_batch_size
    return noise, uniforms, batch, engine


@pytest.mark.parametrize("seed", [0, None])
def test_noise_reveals_nothing_about_the_sampled_batch(seed):
    noise, uniforms, batch, _ = noise_and_batch(seed=seed)
    recovered = uniforms_from_noise(noise, SIGMA * C, N)
    guess = set((recovered < Q).nonzero().flatten().tolist())
    assert len(batch) >= 10
    assert len(guess & set(batch)) <= len(batch) // 3  # chance overlap is q·|batch| ≈ 1; the old engine: all
    correlation = torch.corrcoef(torch.stack([recovered, uniforms.double()]))[0, 1]
    assert abs(float(correlation)) < 0.2  # 8 standard errors at N = 400


def test_noise_is_secret_by_default_and_reproducible_only_on_request():
    secret_a, _, _, engine = noise_and_batch()
    secret_b, _, _, _ = noise_and_batch()
    assert not torch.equal(secret_a, secret_b)
    assert engine.mechanism()["noise_secret"] and "os.urandom" in engine.mechanism()["randomness"]
    seeded_a, _, batch_a, seeded = noise_and_batch(seed=7)
    seeded_b, _, batch_b, _ = noise_and_batch(seed=7)
    assert torch.equal(seeded_a, seeded_b) and batch_a == batch_b
    assert not seeded.mechanism()["noise_secret"] and "secret" in seeded.mechanism()["randomness"]
    with pytest.raises(UserError, match="secure_rng"):
        noise_and_batch(seed=1, secure_rng=True)


def test_no_two_children_share_a_stream():
    root = RandomRoot(0)
    seeds = {(name, rank, stream): root.seed(name, rank, stream)
             for name in CHILDREN for rank in range(4) for stream in range(2)}
    assert len(set(seeds.values())) == len(seeds)
    assert 0 not in seeds.values()  # never the public seed itself
    assert RandomRoot(0).seed("noise") == root.seed("noise")  # a child is a function of (root, name, rank)
    assert RandomRoot().seed("noise") != RandomRoot().seed("noise")  # secret roots are fresh each time
    assert "secret" in repr(RandomRoot()) and str(root.seed("noise")) not in repr(RandomRoot())
    first = [torch.rand(64, generator=root.generator(name)) for name in CHILDREN]
    for i in range(len(first)):
        for j in range(i):
            assert abs(float(torch.corrcoef(torch.stack([first[i], first[j]]))[0, 1])) < 0.5


def test_shuffle_sampling_is_refused_for_private_training():
    model = nn.Linear(3, 2)
    with pytest.raises(UserError, match="poisson"):
        PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                      sample_rate=0.1, dataset_size=100, sampling="shuffle", verify=False)
