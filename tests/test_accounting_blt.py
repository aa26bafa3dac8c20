"""BLT strategies against dense linear algebra and brute force (dptext/accounting/blt.py, blt_strategy.py): C and
C⁻¹ materialised, the sensitivity against every allowed participation pattern, the error objective and its
gradient against dense matrices and finite differences, and the optimiser's result."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest

from dptext.accounting.banded_mf import Participation, toeplitz_sensitivity
from dptext.accounting.blt import (BLT, blt_coefficients, blt_inverse_coefficients, blt_sensitivity,
                                   monotone_toeplitz_sensitivity)
from dptext.accounting.blt_strategy import blt_loss, optimize_blt
from dptext.accounting.mf_strategy import optimize_banded, sqrt_coefficients
from dptext.errors import UserError


def dense_blt(blt: BLT, n: int) -> np.ndarray:
    """C entry by entry from the definition: C[t, t] = c0, C[t, t − j] = Σ_i ω_i θ_i^(j−1)."""
    matrix = np.zeros((n, n))
    for t in range(n):
        matrix[t, t] = blt.c0
        for j in range(1, t + 1):
            matrix[t, t - j] = sum(w * th ** (j - 1) for w, th in zip(blt.omega, blt.theta))
    return matrix


def patterns(n: int, k: int, b: int):
    """Every non-empty set of ≤ k steps of n, any two ≥ b apart (written here, not the library's enumerator)."""
    for size in range(1, k + 1):
        for chosen in itertools.combinations(range(n), size):
            if all(y - x >= b for x, y in zip(chosen, chosen[1:])):
                yield list(chosen)


def brute_sensitivity(matrix: np.ndarray, k: int, b: int) -> float:
    """max over patterns of Σ_{s,t∈π} |(CᵀC)[s, t]|: the supremum over clipped g_t when CᵀC ≥ 0, else a bound."""
    gram = np.abs(matrix.T @ matrix)
    return math.sqrt(max(gram[np.ix_(p, p)].sum() for p in patterns(matrix.shape[0], k, b)))


def random_blt(rng: np.random.Generator, buffers: int) -> BLT:
    return BLT(float(rng.uniform(0.2, 2.0)), tuple(rng.uniform(0.0, 1.0, buffers)),
               tuple(rng.uniform(0.0, 0.999, buffers)))


def test_coefficients_and_inverse_match_the_dense_matrices():
    rng = np.random.default_rng(0)
    for buffers in (1, 2, 4):
        blt = random_blt(rng, buffers)
        matrix = dense_blt(blt, 15)
        np.testing.assert_allclose(blt_coefficients(blt, 15), matrix[:, 0], rtol=1e-13)
        np.testing.assert_allclose(blt_inverse_coefficients(blt, 15), np.linalg.inv(matrix)[:, 0], rtol=1e-9,
                                   atol=1e-12)


@pytest.mark.parametrize("n, k, b", [(6, 2, 3), (9, 3, 2), (10, 2, 4), (12, 4, 3), (8, 8, 1), (11, 3, 5)])
def test_sensitivity_is_the_brute_force_maximum_over_every_pattern(n, k, b):
    rng = np.random.default_rng(n * 100 + k * 10 + b)
    for buffers in (1, 2, 3):
        blt = random_blt(rng, buffers)
        matrix = dense_blt(blt, n)
        brute = brute_sensitivity(matrix, k, b)
        assert blt_sensitivity(blt, n, Participation(k, b)) == pytest.approx(brute, rel=1e-12)
        # the supremum is attained (CᵀC ≥ 0): the same unit gradient at every step of the worst pattern
        attained = max(np.linalg.norm(matrix[:, p].sum(axis=1)) for p in patterns(n, k, b))
        assert attained == pytest.approx(brute, rel=1e-12)
    # random clipped gradients never move the release by more (a spot check of the supremum itself)
    worst = 0.0
    for p in patterns(n, k, b):
        g = rng.normal(size=(len(p), 5))
        g /= np.linalg.norm(g, axis=1, keepdims=True)
        worst = max(worst, float(np.linalg.norm(matrix[:, p] @ g)))
    assert worst <= brute * (1 + 1e-12)


def test_more_participations_than_fit_are_capped_and_one_participation_is_the_first_column():
    blt = BLT(1.0, (0.4, 0.1), (0.9, 0.3))
    n = 10
    assert blt_sensitivity(blt, n, Participation(1, 3)) == pytest.approx(np.linalg.norm(dense_blt(blt, n)[:, 0]))
    assert blt_sensitivity(blt, n, Participation(99, 4)) == pytest.approx(brute_sensitivity(dense_blt(blt, n), 3, 4))


def test_agrees_with_the_banded_dynamic_programme_where_both_apply():
    coeffs = sqrt_coefficients(4)  # non-negative, non-increasing, 4 bands ≤ separation 5
    for steps, k in ((20, 4), (23, 5), (7, 2)):
        padded = np.concatenate([coeffs, np.zeros(steps - coeffs.size)])
        schema = Participation(k, 5)
        assert monotone_toeplitz_sensitivity(padded, schema) == pytest.approx(
            toeplitz_sensitivity(coeffs, steps, schema), rel=1e-12)


def test_coefficients_outside_the_lemma_are_enumerated_or_refused():
    oscillating = BLT(1.0, (0.8,), (-0.7,))  # c_j alternates in sign: CᵀC has negative entries
    for n, k, b in ((9, 3, 2), (12, 2, 5)):
        brute = brute_sensitivity(dense_blt(oscillating, n), k, b)
        assert blt_sensitivity(oscillating, n, Participation(k, b)) == pytest.approx(brute, rel=1e-12)
    with pytest.raises(UserError, match="not all non-negative and non-increasing"):
        blt_sensitivity(oscillating, 40, Participation(3, 10))
    growing = [1.0, 0.2, 0.3, 0.1]  # non-negative but c_2 > c_1: the reduction to π₀ is not proven
    assert monotone_toeplitz_sensitivity(growing, Participation(2, 2)) == pytest.approx(
        brute_sensitivity(np.array([[growing[i - j] if i >= j else 0 for j in range(4)] for i in range(4)]), 2, 2))
    with pytest.raises(UserError, match="A BLT strategy needs"):
        BLT(0.0, (0.5,), (0.5,))
    with pytest.raises(UserError, match="A BLT strategy needs"):
        BLT(1.0, (0.5, 0.1), (0.5,))


@pytest.mark.parametrize("error", ["mean", "max"])
def test_error_objective_matches_dense_matrices_and_its_gradient_finite_differences(error):
    n, schema = 11, Participation(3, 4)
    omega, theta = np.array([0.3, 0.15]), np.array([0.85, 0.4])
    value, grad = blt_loss(omega, theta, n, schema, error)
    matrix = dense_blt(BLT(1.0, tuple(omega), tuple(theta)), n)
    noise_map = np.tril(np.ones((n, n))) @ np.linalg.inv(matrix)  # A C⁻¹
    rows = (noise_map ** 2).sum(axis=1)
    dense = brute_sensitivity(matrix, 3, 4) ** 2 * (rows.mean() if error == "mean" else rows.max())
    assert value == pytest.approx(dense, rel=1e-10)
    x = np.concatenate([omega, theta])
    for i in range(x.size):
        step = np.zeros_like(x)
        step[i] = 1e-6
        plus = blt_loss((x + step)[:2], (x + step)[2:], n, schema, error)[0]
        minus = blt_loss((x - step)[:2], (x - step)[2:], n, schema, error)[0]
        assert grad[i] == pytest.approx((plus - minus) / 2e-6, rel=1e-5, abs=1e-8)


def test_optimised_blt_has_sensitivity_one_and_beats_dp_sgd_and_short_bands():
    steps, schema = 400, Participation(4, 100)
    started = time.perf_counter()
    strategy = optimize_blt(steps, 3, schema)
    assert time.perf_counter() - started < 30  # seconds at start-up (generous: a shared machine)
    assert blt_sensitivity(strategy.blt, steps, schema) == pytest.approx(1.0, rel=1e-9)
    assert all(w >= 0 for w in strategy.blt.omega) and all(0 <= t < 1 for t in strategy.blt.theta)
    # its loss is the objective at the returned strategy (scale-free), far below DP-SGD's k(n + 1)/2
    c0 = strategy.blt.c0
    omega = np.array(strategy.blt.omega) / c0
    assert blt_loss(omega, strategy.blt.theta, steps, schema)[0] == pytest.approx(strategy.loss, rel=1e-9)
    assert strategy.loss < 0.05 * 4 * (steps + 1) / 2
    assert strategy.loss < optimize_banded(steps, 4, schema).loss  # 3 buffers beat 4 bands (3 buffers of noise)
    saved = strategy.to_dict()
    assert saved["mechanism"] == "blt" and saved["buffers"] == 3 and saved["sensitivity"] == 1.0


def test_single_epoch_blt_is_near_the_best_toeplitz_factorisation():
    steps = 128
    blt = optimize_blt(steps, 4, Participation(1, steps)).loss
    banded = optimize_banded(steps, steps, Participation(1, steps)).loss  # every band: the optimal Toeplitz C
    assert blt <= banded * 1.02


def test_max_error_objective_is_the_last_prefix_sums():
    steps, schema = 200, Participation(2, 100)
    worst = optimize_blt(steps, 2, schema, error="max")
    mean = optimize_blt(steps, 2, schema, error="mean")
    omega = lambda s: np.array(s.blt.omega) / s.blt.c0  # noqa: E731 (unscaled ω)
    assert worst.loss <= blt_loss(omega(mean), mean.blt.theta, steps, schema, "max")[0] * (1 + 1e-6)
    assert mean.loss <= blt_loss(omega(worst), worst.blt.theta, steps, schema, "mean")[0] * (1 + 1e-6)


@pytest.mark.parametrize("buffers, error, message", [(0, "mean", "buffers"), (17, "mean", "buffers"),
                                                     (2, "median", "Unknown BLT error")])
def test_bad_settings_are_refused(buffers, error, message):
    with pytest.raises(UserError, match=message):
        optimize_blt(10, buffers, Participation(1, 10), error)
