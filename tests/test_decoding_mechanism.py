"""The λ-perturbed distribution and its ε (SPEC §5), each rule against a brute-force twin."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from dptext.decoding import (
    epsilon_for_lambda,
    epsilon_per_token,
    lambda_for_epsilon,
    perturbed_log_prob_of_targets,
    perturbed_log_probs,
)
from dptext.errors import UserError


def brute_force_q_prime(logits: torch.Tensor, lam: float) -> torch.Tensor:
    """q' = λ softmax(z) + (1 − λ)/|V|, straight from the paper's Eq. (1), in float64."""
    q = torch.softmax(logits.double(), dim=-1)
    return lam * q + (1 - lam) / logits.shape[-1]


def worst_case_ratio(lam: float, vocab_size: int) -> float:
    """max over models and outputs of q'_1(y)/q'_2(y): q_1 puts all mass on y, q_2 none."""
    one_hot = torch.zeros(vocab_size, dtype=torch.float64)
    one_hot[0] = 1.0
    other = torch.zeros(vocab_size, dtype=torch.float64)
    other[1] = 1.0
    mix = lambda q: lam * q + (1 - lam) / vocab_size  # noqa: E731
    return (mix(one_hot)[0] / mix(other)[0]).item()


def test_paper_example_epsilon():
    # Majmudar et al.: |V| ≈ 150,000 and T ≈ 4.75 masked tokens per example give ε ≈ 63 at
    # λ = 0.8 and ε ≈ 59 at λ = 0.6 (Appendix B); 4.75·log(600001) = 63.20.
    assert epsilon_for_lambda(0.8, 150_000, 4.75) == pytest.approx(63.20, abs=0.01)
    assert epsilon_for_lambda(0.6, 150_000, 4.75) == pytest.approx(58.54, abs=0.01)
    assert round(epsilon_for_lambda(0.8, 150_000, 4.75)) == 63


@pytest.mark.parametrize("lam,vocab_size,tokens", [(0.8, 150_000, 4.75), (0.5, 261, 3), (1e-9, 49_152, 20),
                                                   (0.999, 2, 1), (0.3, 10, 0)])
def test_epsilon_is_t_times_log_of_the_worst_case_ratio(lam, vocab_size, tokens):
    expected = tokens * math.log(worst_case_ratio(lam, vocab_size))
    assert epsilon_for_lambda(lam, vocab_size, tokens) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert epsilon_for_lambda(lam, vocab_size, tokens) == pytest.approx(
        tokens * math.log((1 + (vocab_size - 1) * lam) / (1 - lam)), rel=1e-9, abs=1e-12)


def test_epsilon_edges():
    assert epsilon_for_lambda(0.0, 49_152, 100) == 0.0
    assert epsilon_per_token(1.0, 10) == math.inf
    with pytest.raises(UserError):
        epsilon_for_lambda(1.5, 10, 1)
    with pytest.raises(UserError):
        epsilon_for_lambda(-0.1, 10, 1)
    with pytest.raises(UserError):
        epsilon_for_lambda(float("nan"), 10, 1)


@settings(max_examples=200, deadline=None)
@given(lam=st.floats(0.0, 0.999999), vocab_size=st.integers(2, 300_000), tokens=st.floats(0.5, 500))
def test_solver_inverts_the_formula_and_never_overspends(lam, vocab_size, tokens):
    epsilon = epsilon_for_lambda(lam, vocab_size, tokens)
    if epsilon <= 0:
        return
    solved = lambda_for_epsilon(epsilon, vocab_size, tokens)
    assert 0.0 <= solved < 1.0
    assert epsilon_for_lambda(solved, vocab_size, tokens) <= epsilon
    assert solved == pytest.approx(lam, rel=1e-7, abs=1e-12)


def test_solver_keeps_lambda_below_one_for_huge_budgets():
    solved = lambda_for_epsilon(1e6, 49_152, 1)
    assert solved < 1.0 and epsilon_for_lambda(solved, 49_152, 1) <= 1e6
    assert lambda_for_epsilon(63.2, 150_000, 4.75) == pytest.approx(0.8, abs=1e-4)


@pytest.mark.parametrize("epsilon", [0.0, -1.0, float("inf"), float("nan")])
def test_solver_refuses_bad_budgets(epsilon):
    with pytest.raises(UserError):
        lambda_for_epsilon(epsilon, 100, 5)


@pytest.mark.parametrize("lam", [0.0, 0.1, 0.5, 0.8, 0.999])
def test_log_q_prime_matches_brute_force(lam):
    logits = torch.randn(4, 7, 50, generator=torch.Generator().manual_seed(0)) * 5
    ours = perturbed_log_probs(logits, lam)
    assert torch.allclose(ours.double().exp(), brute_force_q_prime(logits, lam), atol=1e-7, rtol=1e-5)
    assert torch.allclose(ours.logsumexp(-1), torch.zeros(4, 7), atol=1e-6)


def test_lambda_one_is_exactly_the_model_and_zero_exactly_uniform():
    logits = torch.randn(3, 100)
    assert torch.equal(perturbed_log_probs(logits, 1.0), torch.log_softmax(logits, dim=-1))
    assert torch.equal(perturbed_log_probs(logits, 0.0), torch.full((3, 100), -math.log(100)))


def test_stable_for_extreme_and_masked_logits():
    logits = torch.tensor([[1e4, -1e4, 0.0, -math.inf], [-math.inf, -math.inf, 3.0, -math.inf]])
    lam, vocab_size = 0.7, 4
    out = perturbed_log_probs(logits, lam)
    assert torch.isfinite(out).all()  # banned (−inf) tokens still get the uniform mass
    floor = math.log((1 - lam) / vocab_size)
    assert (out >= floor - 1e-6).all() and (out <= math.log(lam + (1 - lam) / vocab_size) + 1e-6).all()
    assert perturbed_log_probs(logits.half(), lam).dtype == torch.float32


def test_public_support_restricts_and_renormalises():
    logits = torch.randn(2, 10)
    support = torch.zeros(2, 10, dtype=torch.bool)
    support[0, [1, 4, 7]] = True
    support[1, [0, 2, 9]] = True
    out = perturbed_log_probs(logits, 0.6, support)
    assert torch.isneginf(out[~support]).all()
    assert torch.allclose(out.logsumexp(-1), torch.zeros(2), atol=1e-6)
    restricted = brute_force_q_prime(logits[0, [1, 4, 7]], 0.6)  # k = 3 in place of |V|
    assert torch.allclose(out[0, [1, 4, 7]].double().exp(), restricted, atol=1e-7)


def test_target_only_shortcut_equals_the_full_distribution():
    logits = torch.randn(30, 40)
    targets = torch.randint(0, 40, (30,))
    log_q = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    for lam in (0.0, 0.3, 1.0):
        full = perturbed_log_probs(logits, lam).gather(-1, targets[:, None]).squeeze(-1)
        assert torch.allclose(perturbed_log_prob_of_targets(log_q, lam, 40), full, atol=1e-6)


def test_sampled_frequencies_follow_q_prime():
    logits = torch.randn(20, generator=torch.Generator().manual_seed(1)) * 3
    lam, draws = 0.6, 200_000
    q_prime = brute_force_q_prime(logits, lam)
    sampled = torch.multinomial(perturbed_log_probs(logits, lam).exp(), draws, replacement=True,
                                generator=torch.Generator().manual_seed(2))
    observed = torch.bincount(sampled, minlength=20).double()
    result = chisquare(observed.numpy(), (q_prime * draws).numpy())
    assert result.pvalue > 1e-3, result
