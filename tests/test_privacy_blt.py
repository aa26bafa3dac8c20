"""The BLT engine: its noise's covariance across steps is the strategy's, it resumes bit for bit, one example moves
the release by at most sens·C at the participation it is accounted for (k steps, P apart), and what does not
match is refused (dptext/privacy/mechanisms/blt.py, noise/correlated.py BufferedNoise)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from dptext.accounting.banded_mf import Participation, gaussian_epsilon
from dptext.accounting.blt import BLT, blt_coefficients, blt_sensitivity
from dptext.accounting.blt_strategy import optimize_blt
from dptext.errors import UserError
from dptext.models import load_model
from dptext.privacy.mechanisms.blt import BLTEngine
from dptext.privacy.mechanisms.banded_mf import BandedMFEngine
from mf_cases import check_lifecycle_refusals, noise_of_steps, release_of
from test_privacy_banded_mf import noise_engine as banded_engine

STRATEGY = BLT(1.2, (0.5, 0.2), (0.8, 0.3))


def dense(blt: BLT, steps: int) -> np.ndarray:
    coeffs = blt_coefficients(blt, steps)
    return np.array([[coeffs[i - j] if i >= j else 0.0 for j in range(steps)] for i in range(steps)])


def blt_engine(blt=STRATEGY, steps=6, bins=3, seed=5, coordinates=20000, sigma=1.5, clip=0.4, **options):
    model = nn.Linear(1, coordinates, bias=False)
    engine = BLTEngine(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=sigma,
                       max_grad_norm=clip, dataset_size=30, steps=steps, bins=bins, blt=blt, seed=seed,
                       verify=False, **options)
    return engine, model


def test_noise_covariance_across_steps_is_the_strategys():
    steps, sigma, clip = 7, 1.5, 0.4
    engine, _ = blt_engine(steps=steps, sigma=sigma, clip=clip)
    noise = noise_of_steps(engine, steps)
    inverse = np.linalg.inv(dense(STRATEGY, steps))
    expected = (sigma * clip) ** 2 * inverse @ inverse.T  # Cov(C⁻¹Z) over steps, every coordinate alike
    empirical = noise @ noise.T / noise.shape[1]
    scale = np.sqrt(np.outer(np.diag(expected), np.diag(expected)) / noise.shape[1])
    assert np.all(np.abs(empirical - expected) < 5 * scale + 1e-12), (empirical, expected)
    # C·w is white: the fresh draws, N(0, σ²C²), independent across steps
    white = dense(STRATEGY, steps) @ noise / (sigma * clip)
    assert np.allclose(white @ white.T / noise.shape[1], np.eye(steps), atol=5 / math.sqrt(noise.shape[1]))


def test_noise_is_c_inverse_of_the_fresh_draws_exactly():
    """The same seed's plain DP-SGD draws z, filtered by the dense C⁻¹, give the BLT engine's noise."""
    steps = 5
    engine, _ = blt_engine(steps=steps, coordinates=64, seed=3)
    noise = noise_of_steps(engine, steps)
    plain, _ = blt_engine(blt=BLT(1.0, (0.0,), (0.0,)), steps=steps, coordinates=64, seed=3)  # C = I: z itself
    fresh = noise_of_steps(plain, steps)
    np.testing.assert_allclose(noise, np.linalg.solve(dense(STRATEGY, steps), fresh), rtol=1e-4, atol=1e-5)


def _renamed(state, old: str, new: str):
    """``state`` with every ``old`` key (at any depth) named ``new``: a checkpoint of an earlier dptext."""
    if not isinstance(state, dict):
        return state
    return {(new if k == old else k): _renamed(v, old, new) for k, v in state.items()}


def _keys(state) -> set:
    return set(state) | {k for v in state.values() for k in _keys(v)} if isinstance(state, dict) else set()


@pytest.mark.parametrize("mechanism, key", [("banded_mf", "history"), ("blt", "buffers")])
def test_a_checkpoint_from_before_the_kept_key_resumes_bit_exactly(mechanism, key):
    """Checkpoints before 90b40dd named the filter state "history" (banded MF) or "buffers" (BLT); they resume
    bit-exactly, and one without any is refused."""
    build = banded_engine if mechanism == "banded_mf" else blt_engine
    first, _ = build(coordinates=50, seed=7)
    noise_of_steps(first, 2)
    state = _renamed(dict(first.state_dict()), "kept", key)
    assert "kept" not in _keys(state) and key in _keys(state)
    rest = noise_of_steps(first, 3)
    second, _ = build(coordinates=50, seed=99)
    second.load_state_dict(state)
    np.testing.assert_array_equal(noise_of_steps(second, 3), rest)
    with pytest.raises(ValueError, match="no correlated-noise state"):
        second.load_state_dict(_renamed(state, key, "something_else"))


def test_noise_resumes_bit_exactly_from_its_state():
    first, _ = blt_engine(coordinates=50, seed=7)
    noise_of_steps(first, 2)
    state = dict(first.state_dict())
    rest = noise_of_steps(first, 3)
    second, _ = blt_engine(coordinates=50, seed=99)
    second.load_state_dict(state)
    np.testing.assert_array_equal(noise_of_steps(second, 3), rest)
    other, _ = blt_engine(blt=BLT(1.0, (0.5, 0.2), (0.8, 0.3)), coordinates=50)
    with pytest.raises(ValueError, match="another strategy"):
        other.load_state_dict(state)


def test_removing_one_example_moves_the_release_by_at_most_sens_times_c_at_k_participations():
    """lr = 0 keeps the weights put, so an example's clipped gradient (norm C: the tiny model's are larger) is the
    same at each of its k = 3 steps: the aligned worst case, where the bound is reached by an example of bin 0."""
    steps, bins, clip = 7, 3, 0.5
    schema = Participation(math.ceil(steps / bins), bins)
    strategy = optimize_blt(steps, 2, schema).blt
    generator = torch.Generator().manual_seed(2)
    dataset = {i: torch.randint(5, 200, (6,), generator=generator) for i in range(5)}
    base, _ = load_model("tiny-gpt2", head="causal_lm")

    def make(model, optimizer, size):
        return BLTEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=clip, dataset_size=size,
                         steps=steps, bins=bins, blt=strategy, seed=11, verify=False)

    full, engine = release_of(base, dataset, None, make, dense(strategy, steps))
    assert engine.strategy_sensitivity == pytest.approx(1.0)
    assert engine.schema == Participation(3, 3)
    first_bin = set(next(iter(engine.sampler())))
    assert first_bin, "the seed must put an example in bin 0 (the worst pattern) for the bound to be reached"
    moved = {}
    for drop in dataset:
        without, _ = release_of(base, dataset, drop, make, dense(strategy, steps))
        moved[drop] = float(np.linalg.norm(full - without))
    assert max(moved.values()) <= clip * engine.strategy_sensitivity * (1 + 1e-5)
    assert max(moved[i] for i in first_bin) >= clip * engine.strategy_sensitivity * (1 - 1e-4)  # tight


def test_epsilon_is_the_gaussian_mechanisms_with_the_recomputed_sensitivity():
    engine, _ = blt_engine(steps=6, bins=3, coordinates=4)
    assert engine.epsilon(1e-5) == 0.0
    engine.step()
    sens = blt_sensitivity(STRATEGY, 6, Participation(2, 3))
    assert engine.strategy_sensitivity == pytest.approx(sens)
    assert sens == pytest.approx(np.linalg.norm(dense(STRATEGY, 6)[:, [0, 3]].sum(axis=1)))
    assert engine.epsilon(1e-5, "pld") == pytest.approx(gaussian_epsilon(1.5 / sens, 1e-5), rel=5e-3)
    described = engine.mechanism()
    assert described["method"] == "blt" and described["buffers"] == 2 and described["omega"] == [0.5, 0.2]


def test_mismatched_settings_are_refused():
    model = nn.Linear(1, 2)
    with pytest.raises(UserError, match="Poisson"):
        BLTEngine(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=1.0, max_grad_norm=1.0,
                  dataset_size=10, steps=4, bins=2, blt=STRATEGY, sampling="poisson")

    class Torchrun:  # data-parallel torchrun without FSDP2 sharding
        active, sharded = True, False

    with pytest.raises(UserError, match="train.sharding=fsdp"):
        blt_engine(distributed=Torchrun())
    with pytest.raises(UserError, match="not all non-negative"):  # sensitivity unproven for this C at 40 steps
        blt_engine(blt=BLT(1.0, (0.8,), (-0.7,)), steps=40, bins=10)
    check_lifecycle_refusals(blt_engine(steps=2, coordinates=3)[0], "BLT")


def test_a_banded_checkpoint_does_not_load_into_blt_noise():
    model = nn.Linear(1, 5, bias=False)
    banded = BandedMFEngine(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=1.0,
                            max_grad_norm=1.0, dataset_size=30, steps=6, bins=3, coefficients=[1.0, 0.5], seed=1,
                            verify=False)
    noise_of_steps(banded, 1)
    engine, _ = blt_engine(coordinates=5)
    with pytest.raises(KeyError):
        engine.load_state_dict(banded.state_dict())
