"""The control-code distribution of `dptext synth`: exact frequencies, DP histogram noise scales and their ε."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from scipy import integrate, stats

from dptext.distill.codes import (code_distribution, compose_basic, gaussian_sigma, parse_domain, sample_codes,
                                  total_variation)
from dptext.errors import UserError

RECORDS = ([{"category": "books", "rating": 5}] * 6 + [{"category": "books", "rating": 1}] * 3
           + [{"category": "dvd", "rating": 4}] * 1)
DOMAIN = {"category": ["books", "dvd", "music"], "rating": [1, 2, 4, 5]}


def test_exact_distribution_is_the_empirical_one():
    dist = code_distribution(RECORDS, ["category", "rating"], "exact")
    assert dict(zip(dist.codes, dist.probabilities)) == {("books", 5): 0.6, ("books", 1): 0.3, ("dvd", 4): 0.1}
    assert dist.epsilon == 0 and dist.delta == 0 and dist.mechanism == "exact"
    saved = dist.to_dict()  # plan.json: never exact counts, and the key says what the frequencies are
    assert "noisy_counts" not in saved and "exact_private_frequencies" in saved and "probabilities" not in saved


def test_sampled_codes_follow_the_distribution_and_are_seeded():
    dist = code_distribution(RECORDS, ["category", "rating"], "exact")
    codes = sample_codes(dist, 20000, seed=3)
    assert codes == sample_codes(dist, 20000, seed=3)
    freq = Counter(codes)
    assert freq[("books", 5)] / 20000 == pytest.approx(0.6, abs=0.015)
    assert total_variation(codes, dist) < 0.02
    assert total_variation([("books", 5)] * 10, dist) == pytest.approx(0.4)


def hockey_stick_delta(sigma: float, epsilon: float) -> float:
    """Brute force: δ(ε) = ∫ max(0, p(x) − e^ε q(x)) dx for p = N(1, σ²), q = N(0, σ²)
    (one count moved by 1)."""
    f = lambda x: max(0.0, stats.norm.pdf(x, 1, sigma) - math.exp(epsilon) * stats.norm.pdf(x, 0, sigma))
    # the integrand is positive only right of x* = 1/2 + σ²ε
    start = 0.5 + sigma * sigma * epsilon
    value, _ = integrate.quad(f, start, start + 40 * sigma, limit=400)
    return value


@pytest.mark.parametrize("epsilon,delta", [(0.5, 1e-5), (1.0, 1e-6), (3.0, 1e-3)])
def test_gaussian_sigma_meets_epsilon_delta_exactly(epsilon, delta):
    sigma = gaussian_sigma(epsilon, delta)
    assert hockey_stick_delta(sigma, epsilon) == pytest.approx(delta, rel=1e-4)
    # tighter than the classical σ = √(2 ln(1.25/δ))/ε (valid for ε < 1)
    if epsilon < 1:
        assert sigma < math.sqrt(2 * math.log(1.25 / delta)) / epsilon


@pytest.mark.parametrize("mechanism,epsilon,delta", [("laplace", 0.5, None), ("gaussian", 1.0, 1e-5)])
def test_histogram_noise_has_the_calibrated_scale(mechanism, epsilon, delta):
    domain = {"category": [f"c{i}" for i in range(4000)], "rating": [1]}
    records = [{"category": "c0", "rating": 1}] * 50
    dist = code_distribution(records, ["category", "rating"], mechanism, epsilon=epsilon, delta=delta,
                             domain=domain, seed=7)
    exact = np.zeros(4000)
    exact[0] = 50
    noise = np.asarray(dist.noisy_counts) - exact
    expected_std = math.sqrt(2) / epsilon if mechanism == "laplace" else gaussian_sigma(epsilon, delta)
    assert dist.noise_scale == pytest.approx(1 / epsilon if mechanism == "laplace" else expected_std)
    assert noise.std() == pytest.approx(expected_std, rel=0.05)
    assert abs(noise.mean()) < 4 * expected_std / math.sqrt(4000)
    if mechanism == "laplace":  # the Laplace shape, not just its variance: mean |noise| = b
        assert np.abs(noise).mean() == pytest.approx(1 / epsilon, rel=0.05)
    assert dist.epsilon == epsilon and dist.delta == (delta or 0.0)
    assert min(dist.probabilities) >= 0 and sum(dist.probabilities) == pytest.approx(1)


def test_dp_histogram_is_the_default_and_needs_a_declared_domain():
    with pytest.raises(UserError, match="declared code domain"):
        code_distribution(RECORDS, ["category", "rating"])  # laplace by default; no domain: refused
    dist = code_distribution(RECORDS, ["category", "rating"], domain=DOMAIN, seed=0)
    assert dist.mechanism == "laplace" and dist.epsilon == 1.0  # DEFAULT_CODE_EPSILON
    assert len(dist.codes) == 12 and ("music", 2) in dist.codes  # every declared cell, also empty ones
    assert "probabilities_from_noisy_counts" in dist.to_dict() and len(dist.to_dict()["noisy_counts"]) == 12


def test_a_record_outside_the_domain_is_refused_by_position():
    records = RECORDS + [{"category": "SECRETCAT", "rating": 5}]
    with pytest.raises(UserError) as error:
        code_distribution(records, ["category", "rating"], domain=DOMAIN)
    assert "Training record 11" in str(error.value) and "SECRETCAT" not in str(error.value)


@pytest.mark.parametrize("ratings", [[1, 2, 4, 4, 5], [1, 2, 4, 4.0, 5], [1, 2, "4", 4, 5]])
def test_a_value_listed_twice_in_the_domain_is_refused(ratings):
    """Listed twice, one value is two cells a record counts in: the histogram's sensitivity would be 2, not 1."""
    with pytest.raises(UserError, match=r"lists rating value\(s\) \['4'\] more than once"):
        code_distribution(RECORDS, ["category", "rating"], domain={**DOMAIN, "rating": ratings}, seed=0)
    with pytest.raises(UserError, match="more than once"):
        code_distribution(RECORDS, ["category", "rating"], domain=parse_domain("category=books,dvd;rating=1,4,04"))


def test_basic_composition_adds_epsilon_and_delta():
    dist = code_distribution(RECORDS, ["category", "rating"], "gaussian", epsilon=0.5, delta=1e-6, seed=0,
                             domain=DOMAIN)
    assert compose_basic(2.0, 1e-5, dist) == {"epsilon": 2.5, "delta": pytest.approx(1.1e-5)}
    exact = code_distribution(RECORDS, ["category", "rating"], "exact")
    assert compose_basic(2.0, 1e-5, exact) == {"epsilon": 2.0, "delta": 1e-5}


def test_bad_inputs_are_user_errors():
    with pytest.raises(UserError):
        code_distribution(RECORDS, ["category", "stars"], "exact")
    with pytest.raises(UserError):
        code_distribution(RECORDS, ["category"], "gaussian", epsilon=1.0, domain=DOMAIN)  # no δ
    with pytest.raises(UserError):
        code_distribution(RECORDS, ["category"], "laplace", epsilon=0.0, domain=DOMAIN)
    with pytest.raises(UserError):
        code_distribution(RECORDS, [], "exact")
    assert parse_domain("category=books,dvd;rating=1,2") == {"category": ["books", "dvd"], "rating": [1, 2]}


def test_whole_number_codes_match_the_declared_domain():
    records = [{"category": "books", "rating": 5.0}, {"category": "dvd", "rating": 1}]
    dist = code_distribution(records, ["category", "rating"], "laplace", epsilon=1e6, domain=DOMAIN, seed=0)
    counts = dict(zip(dist.codes, np.round(dist.noisy_counts)))
    assert counts[("books", 5)] == 1 and counts[("dvd", 1)] == 1 and sum(counts.values()) == 2
