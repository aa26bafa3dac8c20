"""The one-run audit's ε lower bound (Steinke, Nasr & Jagielski 2023) against brute-force binomial tails, and its
validity and power on simulated mechanisms of known ε (dptext/attacks/one_run.py)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from dptext.attacks.one_run import epsilon_lower_bound, guesses, one_run_audit, p_value
from dptext.errors import UserError


def brute_tail(r: int, v: int, q: float) -> float:
    """P[Binomial(r, q) ≥ v] summed term by term in exact arithmetic."""
    qq = Fraction(q)
    return float(sum(math.comb(r, j) * qq ** j * (1 - qq) ** (r - j) for j in range(v, r + 1)))


def brute_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """The paper's appendix algorithm: a running sum over i of P[Bin = v − i], its largest mean over i."""
    q = 1 / (1 + math.exp(-eps))
    pmf = [math.comb(r, j) * q ** j * (1 - q) ** (r - j) for j in range(r + 1)]
    alpha = total = 0.0
    for i in range(1, v + 1):
        total += pmf[v - i]
        alpha = max(alpha, total / i)
    return min(brute_tail(r, v, q) + 2 * m * delta * alpha, 1.0)


@pytest.mark.parametrize("m, r, v, eps, delta", [(20, 10, 8, 0.5, 0.0), (50, 30, 25, 1.0, 1e-3),
                                                  (100, 100, 70, 0.2, 1e-5), (40, 12, 12, 3.0, 1e-2),
                                                  (10, 4, 0, 1.0, 0.1)])
def test_p_value_is_the_binomial_tail_plus_the_delta_term(m, r, v, eps, delta):
    assert p_value(m, r, v, eps, delta) == pytest.approx(brute_p_value(m, r, v, eps, delta), rel=1e-9, abs=1e-15)


def test_the_bound_is_the_edge_of_rejection():
    for m, r, v, delta in [(100, 100, 80, 0.0), (1000, 200, 190, 1e-5), (500, 50, 50, 1e-4)]:
        eps = epsilon_lower_bound(m, r, v, delta, 0.95)
        assert eps > 0
        assert p_value(m, r, v, eps, delta) <= 0.05 < p_value(m, r, v, eps * (1 + 1e-6) + 1e-9, delta)
    # all r guesses right, δ = 0: q^r = β in closed form
    eps = epsilon_lower_bound(1000, 1000, 1000, 0.0, 0.95)
    q = 0.05 ** (1 / 1000)
    assert eps == pytest.approx(math.log(q / (1 - q)), rel=1e-9)


def test_chance_guessing_gives_zero_and_more_correct_gives_more():
    assert epsilon_lower_bound(100, 100, 50, 1e-5) == 0.0
    bounds = [epsilon_lower_bound(400, 200, v, 1e-5) for v in (120, 150, 180, 200)]
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    assert epsilon_lower_bound(400, 200, 180, 1e-2) < epsilon_lower_bound(400, 200, 180, 1e-6)  # δ costs


def test_guesses_take_the_extremes_and_abstain_in_between():
    scores = [0.9, 0.1, 0.8, 0.5, 0.2, 0.7]
    included = [True, False, False, True, False, True]
    assert guesses(scores, included, 2, 2) == (4, 3)  # in: 0.9 ✓, 0.8 ✗; out: 0.1 ✓, 0.2 ✓
    assert guesses(scores, included, 0, 0) == (0, 0)
    with pytest.raises(UserError):
        guesses(scores, included, 4, 3)


def randomized_response_audit(epsilon: float, m: int, rng) -> float:
    """One 'run' of an ε-DP mechanism that reveals each inclusion bit by randomized response; the auditor guesses
    on every canary."""
    included = rng.random(m) < 0.5
    truthful = rng.random(m) < math.exp(epsilon) / (1 + math.exp(epsilon))
    scores = np.where(truthful, included, ~included) + 1e-3 * rng.random(m)
    return one_run_audit(scores, included, delta=0.0, k_plus=m // 2, k_minus=m - m // 2).epsilon


def test_on_an_eps_dp_mechanism_the_bound_rarely_exceeds_eps_and_is_not_vacuous():
    rng = np.random.default_rng(0)
    bounds = np.array([randomized_response_audit(1.0, 400, rng) for _ in range(200)])
    assert np.mean(bounds > 1.0) <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 200)  # a 95% bound: ≤ 5% (+ 3 s.e.)
    assert np.median(bounds) > 0.6  # and it sees most of the ε that is there


def test_a_broken_mechanism_is_caught():
    """No noise: every canary's inclusion shows; the bound far exceeds any ε a recipe would claim."""
    rng = np.random.default_rng(1)
    included = rng.random(1000) < 0.5
    result = one_run_audit(included.astype(float) + 1e-3 * rng.random(1000), included, delta=1e-5, k_plus=100,
                           k_minus=100)
    assert result.correct == 200 and result.epsilon > 3.0
