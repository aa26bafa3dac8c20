"""Banded matrix-factorization accounting: sensitivity against brute force, ε against a second accountant, and the
strategy objective against dense linear algebra (dptext/accounting/banded_mf.py, mf_strategy.py)."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest
from scipy.linalg import sqrtm

from dptext.accounting.banded_mf import (Participation, allowed_patterns, best_pattern, gaussian_epsilon,
                                         gaussian_log_delta, gaussian_sigma_for, inverse_coefficients, mf_epsilon,
                                         sensitivity, toeplitz_sensitivity, toeplitz_strategy)
from dptext.accounting.mf_strategy import optimize_banded, prefix_sum_loss, sqrt_coefficients
from dptext.errors import UserError

SCHEMAS = [Participation(1, 8), Participation(2, 3), Participation(3, 2), Participation(4, 1), Participation(2, 5)]


def random_banded(steps: int, band: int, seed: int, signed: bool = True) -> np.ndarray:
    """A lower-triangular b-banded matrix with random (not Toeplitz) entries."""
    rng = np.random.default_rng(seed)
    matrix = rng.normal(size=(steps, steps)) if signed else rng.uniform(0.1, 1, size=(steps, steps))
    rows, cols = np.indices(matrix.shape)
    return np.where((rows >= cols) & (rows - cols < band), matrix, 0.0)


def brute_force_sensitivity(strategy: np.ndarray, schema: Participation) -> tuple[float, float]:
    """Over every allowed pattern: the largest ‖Σ_{t∈π} s_t C[:, t]‖ over signs s (g_t = ±e, attained) and the
    largest upper bound Σ_{s,t∈π} |⟨C_s, C_t⟩| (any g_t of norm ≤ 1), both square-rooted."""
    attained = bound = 0.0
    gram = strategy.T @ strategy
    for pattern in allowed_patterns(strategy.shape[0], schema):
        for signs in itertools.product((1.0, -1.0), repeat=len(pattern)):
            attained = max(attained, float(np.linalg.norm(strategy[:, list(pattern)] @ np.array(signs))))
        bound = max(bound, math.sqrt(np.abs(gram[np.ix_(pattern, pattern)]).sum()))
    return attained, bound


def allowed(pattern, schema: Participation) -> bool:
    return len(pattern) <= schema.max_participations and all(
        b - a >= schema.separation for a, b in zip(pattern, pattern[1:]))


@pytest.mark.parametrize("schema", SCHEMAS, ids=str)
def test_banded_sensitivity_is_the_brute_force_maximum(schema):
    for seed in range(3):
        strategy = random_banded(8, schema.separation, seed)
        attained, bound = brute_force_sensitivity(strategy, schema)
        assert sensitivity(strategy, schema) == pytest.approx(attained, rel=1e-12)
        assert attained == pytest.approx(bound, rel=1e-12)  # disjoint column supports: the supremum is exact


def test_wide_band_sensitivity_bounds_every_pattern_and_is_attained_for_positive_gram():
    schema = Participation(2, 2)
    strategy = random_banded(7, 4, 0, signed=False)  # CᵀC ≥ 0: all gradients alike is the worst case
    attained, bound = brute_force_sensitivity(strategy, schema)
    assert sensitivity(strategy, schema) == pytest.approx(bound) == pytest.approx(attained)
    signed = random_banded(7, 4, 1)
    assert sensitivity(signed, schema) >= brute_force_sensitivity(signed, schema)[0] - 1e-12


def test_remove_one_unit_moves_the_release_by_at_most_the_sensitivity():
    rng = np.random.default_rng(0)
    schema, steps, dim = Participation(3, 4), 14, 5
    coeffs = np.array([1.0, -0.4, 0.3, 0.2])
    strategy, sens = toeplitz_strategy(coeffs, steps), toeplitz_sensitivity(coeffs, steps, schema)
    patterns = list(allowed_patterns(steps, schema))
    worst = 0.0
    for _ in range(400):
        pattern = patterns[rng.integers(len(patterns))]
        unit = np.zeros((steps, dim))
        rows = rng.normal(size=(len(pattern), dim))
        unit[list(pattern)] = rows / np.maximum(1.0, np.linalg.norm(rows, axis=1, keepdims=True))
        worst = max(worst, float(np.linalg.norm(strategy @ unit)))  # C·(G + unit) − C·G
        assert worst <= sens + 1e-12
    assert worst > 0.5 * sens


def test_best_pattern_matches_enumeration():
    rng = np.random.default_rng(3)
    for schema in SCHEMAS:
        weights = rng.uniform(0, 1, size=9)
        best, pattern = best_pattern(weights, schema)
        expected = max(weights[list(p)].sum() for p in allowed_patterns(9, schema))
        assert best == pytest.approx(expected)
        assert allowed(pattern, schema) and weights[pattern].sum() == pytest.approx(best)


def test_toeplitz_sensitivity_without_the_matrix_and_truncated_columns():
    coeffs = [1.0, 0.5, -0.25]
    for schema in SCHEMAS[:4]:
        if len(coeffs) <= schema.separation:
            assert toeplitz_sensitivity(coeffs, 10, schema) == pytest.approx(
                sensitivity(toeplitz_strategy(coeffs, 10), schema))
    # k·b > n: the last participation lands on a truncated column
    assert toeplitz_sensitivity(coeffs, 5, Participation(2, 3)) == pytest.approx(math.sqrt(1.3125 + 1.25))


def test_refusals():
    with pytest.raises(UserError, match="lower-triangular"):
        sensitivity(np.triu(np.ones((4, 4))), Participation(1, 4))
    with pytest.raises(UserError, match="wider than the minimum separation"):
        sensitivity(toeplitz_strategy([1.0, 0.5, 0.2], 40), Participation(3, 2))
    with pytest.raises(UserError, match="c_0"):
        toeplitz_strategy([0.0, 1.0], 5)
    with pytest.raises(UserError, match="bands"):
        optimize_banded(100, 5, Participation(2, 4))


def test_dp_sgd_is_the_identity_strategy():
    schema = Participation(3, 1)
    assert toeplitz_sensitivity([1.0], 10, schema) == pytest.approx(math.sqrt(3))
    assert mf_epsilon(2.0 * math.sqrt(3), math.sqrt(3), 1e-5) == pytest.approx(gaussian_epsilon(2.0, 1e-5))


@pytest.mark.parametrize("sigma", [0.6, 1.0, 3.0, 10.0])
def test_gaussian_epsilon_against_the_pld_accountant(sigma):
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_event.GaussianDpEvent(sigma))
    pld = accountant.get_epsilon(1e-5)
    exact = gaussian_epsilon(sigma, 1e-5)
    assert exact <= pld + 1e-9 and exact == pytest.approx(pld, rel=2e-3, abs=2e-3)
    assert math.exp(gaussian_log_delta(exact, sigma)) == pytest.approx(1e-5, rel=1e-6)


def test_gaussian_sigma_for_inverts_epsilon():
    for eps in (0.5, 3.0, 8.0):
        sigma = gaussian_sigma_for(eps, 1e-6)
        assert gaussian_epsilon(sigma, 1e-6) <= eps
        assert gaussian_epsilon(sigma, 1e-6) == pytest.approx(eps, rel=1e-6)


def dense_loss(coeffs, steps: int, schema: Participation) -> float:
    strategy = toeplitz_strategy(coeffs, steps)
    workload = np.tril(np.ones((steps, steps)))
    return sensitivity(strategy, schema) ** 2 * np.linalg.norm(workload @ np.linalg.inv(strategy)) ** 2 / steps


def test_prefix_sum_loss_and_gradient_against_dense_algebra():
    coeffs, schema = np.array([1.0, -0.3, 0.2, 0.05]), Participation(3, 4)
    loss, grad = prefix_sum_loss(coeffs, 12, schema)
    assert loss == pytest.approx(dense_loss(coeffs, 12, schema), rel=1e-10)
    assert np.allclose(inverse_coefficients(coeffs, 12), np.linalg.inv(toeplitz_strategy(coeffs, 12))[:, 0])
    step = 1e-6
    numeric = [(prefix_sum_loss(coeffs + step * e, 12, schema)[0] - prefix_sum_loss(coeffs - step * e, 12, schema)[0])
               / (2 * step) for e in np.eye(4)]
    assert np.allclose(grad, numeric, rtol=1e-5)


def test_square_root_factorisation_closed_form():
    steps = 12
    root = np.real(sqrtm(np.tril(np.ones((steps, steps)))))
    assert np.allclose(root[:, 0], sqrt_coefficients(steps), atol=1e-8)
    # C = A^{1/2}: A C⁻¹ = C, so the single-epoch loss is (Σ_j c_j²)·Σ_t (n − t) c_t² / n
    coeffs = sqrt_coefficients(steps)
    expected = np.sum(coeffs ** 2) * np.sum((steps - np.arange(steps)) * coeffs ** 2) / steps
    assert prefix_sum_loss(coeffs, steps, Participation(1, steps))[0] == pytest.approx(expected)


def test_optimised_strategies():
    steps = 64
    dp_sgd = optimize_banded(steps, 1, Participation(2, 32))
    assert dp_sgd.coefficients == pytest.approx((1 / math.sqrt(2),)) and dp_sgd.loss == pytest.approx(2 * 65 / 2)
    losses = [optimize_banded(steps, b, Participation(2, 32)).loss for b in (1, 2, 4, 8, 32)]
    assert all(a > b for a, b in zip(losses, losses[1:]))  # more bands never hurt (a superset of strategies)
    full = optimize_banded(steps, steps, Participation(1, steps))
    sqrt_loss = prefix_sum_loss(sqrt_coefficients(steps), steps, Participation(1, steps))[0]
    assert full.loss <= sqrt_loss and full.loss > 0.9 * sqrt_loss  # the square root is near-optimal (Toeplitz)
    assert toeplitz_sensitivity(full.coefficients, steps, full.schema) == pytest.approx(1.0)
    assert dense_loss(full.coefficients, steps, full.schema) == pytest.approx(full.loss, rel=1e-8)


def test_optimisation_takes_seconds_for_thousands_of_steps():
    start = time.perf_counter()
    strategy = optimize_banded(2000, 64, Participation(4, 500))
    assert time.perf_counter() - start < 10
    assert strategy.loss < 0.05 * (4 * 2001 / 2)  # far below DP-SGD's k(n + 1)/2 at the same ε
