"""The banded MF engine: its noise's covariance across steps is the strategy's, its sampler produces only the
participation it is accounted for, one example moves the release by at most sens·C, and what does not match is
refused (dptext/privacy/mechanisms/banded_mf.py, noise/correlated.py, sampling/cyclic.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from dptext.accounting.banded_mf import Participation, allowed_patterns, gaussian_epsilon, toeplitz_strategy
from dptext.accounting.mf_strategy import optimize_banded
from dptext.errors import UserError
from dptext.models import load_model
from dptext.privacy.mechanisms.banded_mf import BandedMFEngine
from dptext.privacy.sampling.cyclic import CyclicBinSampler
from mf_cases import check_lifecycle_refusals, noise_of_steps, release_of

COEFFS = [1.0, -0.5, 0.3]


def noise_engine(coefficients=COEFFS, steps=6, bins=3, seed=5, coordinates=20000, sigma=1.5, clip=0.4):
    model = nn.Linear(1, coordinates, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = BandedMFEngine(model, optimizer, noise_multiplier=sigma, max_grad_norm=clip, dataset_size=30,
                            steps=steps, bins=bins, coefficients=coefficients, seed=seed, verify=False)
    return engine, model


def test_noise_covariance_across_steps_is_the_strategys():
    steps, sigma, clip = 6, 1.5, 0.4
    engine, _ = noise_engine(steps=steps, sigma=sigma, clip=clip)
    noise = noise_of_steps(engine, steps)
    coordinates = noise.shape[1]
    inverse = np.linalg.inv(toeplitz_strategy(COEFFS, steps))
    expected = (sigma * clip) ** 2 * inverse @ inverse.T  # Cov(C⁻¹Z) over steps, every coordinate alike
    empirical = noise @ noise.T / coordinates
    tolerance = 5 * (sigma * clip) ** 2 * np.sqrt(np.outer(np.diag(inverse @ inverse.T), np.diag(inverse @ inverse.T))
                                                  / coordinates) + 1e-12
    assert np.all(np.abs(empirical - expected) < tolerance), (empirical, expected)
    # C·w is white: the fresh draws, N(0, σ²C²), independent across steps
    white = toeplitz_strategy(COEFFS, steps) @ noise / (sigma * clip)
    assert np.allclose(white @ white.T / coordinates, np.eye(steps), atol=5 / math.sqrt(coordinates))


def test_noise_resumes_bit_exactly_from_its_state():
    first, _ = noise_engine(coordinates=50, seed=7)
    noise_of_steps(first, 2)
    state = {k: v for k, v in first.state_dict().items()}
    rest = noise_of_steps(first, 3)
    second, _ = noise_engine(coordinates=50, seed=99)
    second.load_state_dict(state)
    np.testing.assert_array_equal(noise_of_steps(second, 3), rest)


def test_one_band_is_dp_sgd_noise():
    engine, _ = noise_engine(coefficients=[1.0], steps=4, coordinates=20000)
    noise = noise_of_steps(engine, 4)
    empirical = noise @ noise.T / noise.shape[1]
    assert np.allclose(empirical, (1.5 * 0.4) ** 2 * np.eye(4), atol=5 * 0.36 / math.sqrt(20000) * 1.5)


def test_cyclic_bins_give_exactly_the_accounted_participation():
    sampler = CyclicBinSampler(50, 4, 11, torch.Generator().manual_seed(0))
    assert sampler.schema == Participation(3, 4)
    steps_of: dict[int, list[int]] = {}
    for step, batch in enumerate(sampler):
        for index in batch:
            steps_of.setdefault(index, []).append(step)
    assert sorted(steps_of) == list(range(50))  # every example trains, each in one bin
    patterns = set(allowed_patterns(11, sampler.schema))
    assert all(tuple(steps) in patterns for steps in steps_of.values())
    # resume: the bins are re-drawn from the saved state and the cycle continues where it stopped
    resumed = CyclicBinSampler(50, 4, 11, torch.Generator().manual_seed(123))
    resumed.generator.set_state(sampler.generator.get_state())
    resumed.steps = 11 - 6
    assert list(resumed) == list(sampler)[6:]


def banded_engine(steps: int, bins: int, coefficients):
    return lambda model, optimizer, size: BandedMFEngine(
        model, optimizer, noise_multiplier=0.0, max_grad_norm=0.5, dataset_size=size, steps=steps, bins=bins,
        coefficients=coefficients, seed=11, verify=False)


def test_removing_one_example_moves_the_release_by_at_most_sens_times_c():
    steps, bins = 7, 3
    strategy = optimize_banded(steps, 3, Participation(math.ceil(steps / bins), bins))
    generator = torch.Generator().manual_seed(2)
    dataset = {i: torch.randint(5, 200, (8,), generator=generator) for i in range(9)}
    base, _ = load_model("tiny-gpt2", head="causal_lm")
    make, matrix = banded_engine(steps, bins, strategy.coefficients), toeplitz_strategy(strategy.coefficients, steps)
    full, engine = release_of(base, dataset, None, make, matrix)
    assert engine.strategy_sensitivity == pytest.approx(1.0)
    worst = 0.0
    for drop in range(9):
        without, _ = release_of(base, dataset, drop, make, matrix)
        worst = max(worst, float(np.linalg.norm(full - without)))
    assert worst <= 0.5 * engine.strategy_sensitivity * (1 + 1e-5)
    assert worst > 0.5 * 0.5  # an example does move it: the bound is not vacuous


def test_epsilon_is_the_gaussian_mechanisms_with_the_recomputed_sensitivity():
    engine, _ = noise_engine(coefficients=[2.0, 1.0], steps=6, bins=3, coordinates=4)
    assert engine.epsilon(1e-5) == 0.0
    engine.step()
    sens = math.sqrt(2 * (4 + 1))  # two participations, full columns
    assert engine.strategy_sensitivity == pytest.approx(sens)
    assert engine.epsilon(1e-5, "pld") == pytest.approx(gaussian_epsilon(1.5 / sens, 1e-5), rel=5e-3)
    assert engine.mechanism()["method"] == "banded_mf"


def test_mismatched_settings_are_refused():
    model = nn.Linear(1, 2)
    with pytest.raises(UserError, match="Poisson"):
        BandedMFEngine(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=1.0, max_grad_norm=1.0,
                       dataset_size=10, steps=4, bins=2, coefficients=[1.0], sampling="poisson")
    with pytest.raises(UserError, match="wider than the separation"):
        noise_engine(coefficients=[1.0, 0.5, 0.2, 0.1], bins=3)
    check_lifecycle_refusals(noise_engine(steps=2, coordinates=3)[0], "banded MF")
