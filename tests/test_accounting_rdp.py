"""RDP of the Poisson-subsampled Gaussian: closed forms, brute-force twins, dp-accounting, monotonicity."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, stats

from dptext.accounting import rdp
from dptext.accounting.events import StepRun

ORDERS = rdp.DEFAULT_ORDERS


def brute_force_rdp(q: float, sigma: float, alpha: float) -> float:
    """r(α) = log E_{z~N(0,σ²)}[(1 − q + q·e^{(2z−1)/(2σ²)})^α] / (α − 1) by adaptive quadrature."""
    def integrand(z: float) -> float:
        return stats.norm.pdf(z, scale=sigma) * (1 - q + q * math.exp((2 * z - 1) / (2 * sigma**2))) ** alpha

    # The mass sits near 0 (the 1 − q part) and near z = α (the q·e^{...} part).
    points = sorted({0.0, 0.5, float(alpha)})
    value, _ = integrate.quad(integrand, -30 * sigma, alpha + 30 * sigma, points=points, limit=400,
                              epsabs=0, epsrel=1e-12)
    return math.log(value) / (alpha - 1)


def test_full_batch_is_the_gaussian_mechanism_exactly():
    for sigma in (0.5, 1.0, 3.7):
        for steps in (1, 10, 1000):
            total = rdp.rdp_of_runs([StepRun(1.0, sigma, steps)])
            np.testing.assert_allclose(total, steps * ORDERS / (2 * sigma**2), rtol=1e-15, atol=0)


@pytest.mark.parametrize("q,sigma,alpha", [
    (0.01, 1.0, 1.1), (0.01, 1.0, 2.5), (0.01, 1.0, 7.8), (0.1, 1.0, 1.6), (0.5, 2.0, 1.9),
    (0.05, 0.8, 3.3), (0.3, 5.0, 10.5), (0.01, 5.0, 1.1), (0.02, 1.2, 12.0), (0.2, 2.0, 30.0),
])
def test_matches_brute_force_quadrature(q, sigma, alpha):
    ours = rdp.rdp_subsampled_gaussian(q, sigma, [alpha])[0]
    assert ours == pytest.approx(brute_force_rdp(q, sigma, alpha), rel=1e-7)


def test_fractional_series_reproduces_the_integer_sum_at_integer_orders():
    # At integer α the series terms beyond i = α vanish: it is the binomial sum, so both
    # code paths must agree to rounding.
    alphas = np.array([2.0, 3.0, 5.0, 8.0])
    for q, sigma in [(0.01, 1.0), (0.2, 0.7), (0.9, 3.0)]:
        series = rdp._log_a_fractional(q, sigma, alphas)
        integer = np.logaddexp(0.0, rdp._log_a_minus_1_integer(q, sigma, alphas))
        np.testing.assert_allclose(series, integer, rtol=1e-9)


def test_is_finite_nonnegative_and_nondecreasing_in_the_order_for_extreme_inputs():
    # RDP of any mechanism is non-decreasing in α; tiny q and large orders must not overflow.
    # Fractional orders may over-state r by < 1e-9 (the series' tail bound, see rdp.py).
    for q in (1e-7, 1e-4, 0.01, 0.5, 0.999):
        for sigma in (0.3, 1.0, 50.0, 1e4):
            r = rdp.rdp_subsampled_gaussian(q, sigma)
            assert np.all(np.isfinite(r)) and np.all(r >= 0)
            assert np.all(np.diff(r) >= -1e-9 - 1e-12 * r[1:])


def test_small_sampling_rate_keeps_relative_precision_at_integer_orders():
    # For q → 0, A_α − 1 ≈ C(α,2) q² (e^{1/σ²} − 1): r ≈ α q² (e^{1/σ²} − 1) / 2.
    q, sigma = 1e-8, 2.0
    r = rdp.rdp_subsampled_gaussian(q, sigma, [2.0, 10.0])
    expected = np.array([2.0, 10.0]) * q**2 * math.expm1(1 / sigma**2) / 2
    np.testing.assert_allclose(r, expected, rtol=1e-6)


def test_reference_value():
    eps, order = rdp.rdp_epsilon([StepRun(0.01, 1.0, 1000)], 1e-5)
    assert round(eps, 3) == 2.101
    assert 1 < order < 64


def test_classical_conversion_is_never_tighter():
    runs = [StepRun(0.02, 1.1, 500)]
    improved, _ = rdp.rdp_epsilon(runs, 1e-5)
    classical, _ = rdp.rdp_epsilon(runs, 1e-5, conversion="classical")
    assert classical > improved
    total = rdp.rdp_of_runs(runs)
    assert classical == pytest.approx(np.min(total - math.log(1e-5) / (ORDERS - 1)), rel=1e-12)


def test_schedules_compose_additively():
    mixed = [StepRun(0.01, 1.0, 300), StepRun(0.01, 0.8, 200), StepRun(0.01, 1.0, 100)]
    expected = 400 * rdp.rdp_subsampled_gaussian(0.01, 1.0) + 200 * rdp.rdp_subsampled_gaussian(0.01, 0.8)
    np.testing.assert_allclose(rdp.rdp_of_runs(mixed), expected, rtol=1e-14)


GRID = [(q, sigma, steps, delta)
        for q, sigma, steps, delta in [
            (0.01, 1.0, 1000, 1e-5), (0.001, 0.8, 10000, 1e-6), (0.05, 2.0, 300, 1e-5), (0.1, 5.0, 100, 1e-3),
            (0.004, 0.6, 2000, 1e-5), (0.2, 1.5, 50, 1e-6), (1.0, 10.0, 10, 1e-5), (0.02, 0.9, 5000, 1e-8),
        ]]


@pytest.mark.parametrize("q,sigma,steps,delta", GRID)
def test_matches_dp_accounting(q, sigma, steps, delta):
    dp_event = pytest.importorskip("dp_accounting.dp_event")
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant(orders=list(ORDERS))
    accountant.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    ours, _ = rdp.rdp_epsilon([StepRun(q, sigma, steps)], delta)
    assert ours == pytest.approx(accountant.get_epsilon(delta), rel=1e-3)


@pytest.mark.parametrize("method", ["rdp", "gdp"])
def test_epsilon_grows_with_steps_and_rate_and_falls_with_noise(method):
    from dptext.accounting.epsilon import compute_epsilon

    def eps(q, sigma, steps):
        return compute_epsilon(method, [StepRun(q, sigma, steps)], 1e-5).epsilon

    by_steps = [eps(0.01, 1.0, s) for s in (10, 100, 1000, 10000)]
    by_rate = [eps(q, 1.0, 1000) for q in (0.001, 0.005, 0.01, 0.05)]
    by_noise = [eps(0.01, s, 1000) for s in (0.6, 0.8, 1.0, 2.0, 4.0)]
    assert by_steps == sorted(by_steps) and len(set(by_steps)) == 4
    assert by_rate == sorted(by_rate) and len(set(by_rate)) == 4
    assert by_noise == sorted(by_noise, reverse=True) and len(set(by_noise)) == 5
