"""The one-run audit's statistics (Steinke, Nasr & Jagielski 2023, "Privacy auditing with one (1) training run").

m canaries are each included in training independently with probability ½ (public coins, drawn before
training). After the one run the auditor scores every canary, guesses "in" for the k₊ highest scores and "out"
for the k₋ lowest, and abstains on the rest: r = k₊ + k₋ guesses, v of them correct. Their Theorem 3.1: if the
training is ε-DP, W (the number of correct guesses) is stochastically dominated by Binomial(r, e^ε/(1+e^ε)); for
(ε, δ)-DP (their Theorem 3.2 / Proposition 5.7) the tail gains δ·2m·max_{i=1..v} P[v − i ≤ Binomial < v]/i.
So

    p(ε) = P[Binomial(r, q_ε) ≥ v] + 2mδ · max_{1≤i≤v} P[v − i ≤ Binomial(r, q_ε) < v] / i,   q_ε = e^ε/(1+e^ε)

is a p-value for "the run is (ε, δ)-DP". It grows with ε, so the lower bound at confidence 1 − β is the largest
ε with p(ε) ≤ β: every smaller ε is rejected at level β. On a correct engine this bound exceeds the proven ε
with probability at most β; k₊ and k₋ must be fixed before the scores are seen (searching over them would spend
that β many times).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import binom

from dptext.errors import UserError


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P-value of ≥ v correct guesses out of r (m canaries) if the training is (ε, δ)-DP (module docstring)."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    q = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(binom.sf(v - 1, r, q))  # P[Binomial(r, q) >= v]
    if delta == 0 or v == 0:
        return min(tail, 1.0)
    below = np.cumsum(binom.pmf(np.arange(v - 1, -1, -1), r, q))  # P[v − i ≤ Bin < v] for i = 1..v
    spread = float(np.max(below / np.arange(1, v + 1)))
    return min(tail + 2 * m * delta * spread, 1.0)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float = 0.95) -> float:
    """The largest ε such that ≥ v correct of r still has p-value ≤ 1 − ``confidence`` (0 if none)."""
    if not 0 < confidence < 1:
        raise UserError(f"The confidence must lie in (0, 1), got {confidence!r}.")
    if not 0 <= delta < 1:
        raise UserError(f"δ must lie in [0, 1), got {delta!r}.")
    beta = 1 - confidence
    if r == 0 or p_value(m, r, v, 0.0, delta) > beta:
        return 0.0
    low, high = 0.0, 1.0
    while p_value(m, r, v, high, delta) <= beta and high < 1e3:
        low, high = high, 2 * high
    for _ in range(60):  # bisection to ~1e-15 relative: p is monotone in ε
        middle = (low + high) / 2
        low, high = (middle, high) if p_value(m, r, v, middle, delta) <= beta else (low, middle)
    return low


@dataclass(frozen=True)
class OneRunResult:
    canaries: int  # m
    guesses: int  # r = k₊ + k₋
    correct: int  # v
    epsilon: float  # the lower bound
    confidence: float
    delta: float

    def to_dict(self) -> dict:
        return {"canaries": self.canaries, "guesses": self.guesses, "correct": self.correct,
                "epsilon_lower_bound": self.epsilon, "confidence": self.confidence, "delta": self.delta,
                "method": "one run (Steinke, Nasr & Jagielski 2023, Thm 3.2)"}


def guesses(scores, included, k_plus: int, k_minus: int) -> tuple[int, int]:
    """(r, v): "in" for the ``k_plus`` highest scores, "out" for the ``k_minus`` lowest; ties broken by index."""
    scores, included = np.asarray(scores, dtype=float), np.asarray(included, dtype=bool)
    m = scores.size
    if included.size != m or k_plus < 0 or k_minus < 0 or k_plus + k_minus > m:
        raise UserError(f"One-run guesses need k₊ + k₋ ≤ m = {m} canaries (got k₊={k_plus}, k₋={k_minus}).")
    order = np.argsort(-scores, kind="stable")  # highest score first
    guessed_in, guessed_out = order[:k_plus], order[m - k_minus:] if k_minus else order[:0]
    return k_plus + k_minus, int(included[guessed_in].sum() + (~included[guessed_out]).sum())


def one_run_audit(scores, included, delta: float, k_plus: int, k_minus: int,
                  confidence: float = 0.95) -> OneRunResult:
    """The audit of one run from each canary's score (higher = more likely trained on) and inclusion bit."""
    r, v = guesses(scores, included, k_plus, k_minus)
    m = len(scores)
    return OneRunResult(m, r, v, epsilon_lower_bound(m, r, v, delta, confidence), confidence, delta)
