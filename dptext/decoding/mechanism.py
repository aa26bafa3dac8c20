"""The λ-perturbed distribution of Majmudar et al. and its privacy loss (SPEC §5).

q' = λ·q + (1 − λ)·u over a support of size |V|, followed by random sampling, is an
ε-DP prediction for up to T sampled tokens with

    ε = T · log((1 + (|V| − 1)·λ) / (1 − λ)),       λ ∈ [0, 1).

The bound only needs every entry of q' to lie in [(1 − λ)/|V|, λ + (1 − λ)/|V|], which holds
for *any* q on the simplex; so anything that reshapes q before the mixing (temperature,
repetition penalties, banned words) is free, while anything that reshapes q' after it
(top-k, top-p, a second temperature, greedy or beam search) voids the guarantee.

Pure numerics, no model knowledge: this is what the tests check against brute force.
"""

from __future__ import annotations

import math

import torch

from dptext.errors import UserError


def check_lambda(lam: float, allow_one: bool = False) -> float:
    """``lam`` as a float, refusing values outside [0, 1) ([0, 1] with ``allow_one``)."""
    lam = float(lam)
    upper_ok = lam <= 1.0 if allow_one else lam < 1.0
    if not (math.isfinite(lam) and lam >= 0.0 and upper_ok):
        interval = "[0, 1]" if allow_one else "[0, 1) (λ = 1 is the raw model, with no privacy at all)"
        raise UserError(f"λ must lie in {interval}, got {lam}; pick e.g. --lambda 0.8 or give --eps instead.")
    return lam


def _check_support(vocab_size: int) -> int:
    if int(vocab_size) != vocab_size or vocab_size < 1:
        raise UserError(f"The support size |V| must be a positive integer, got {vocab_size}.")
    return int(vocab_size)


def epsilon_per_token(lam: float, vocab_size: int) -> float:
    """log((1 + (|V| − 1)λ) / (1 − λ)): the privacy loss of one sampled token; inf at λ = 1."""
    lam = check_lambda(lam, allow_one=True)
    vocab_size = _check_support(vocab_size)
    if lam == 1.0:
        return math.inf
    # log1p keeps full precision for tiny λ, where the ratio is barely above 1.
    return math.log1p((vocab_size - 1) * lam) - math.log1p(-lam)


def epsilon_for_lambda(lam: float, vocab_size: int, tokens: float) -> float:
    """ε = T · log((1 + (|V| − 1)λ) / (1 − λ)) for up to ``tokens`` = T sampled tokens."""
    if not (math.isfinite(tokens) and tokens >= 0):
        raise UserError(f"The number of predicted tokens T must be a finite number ≥ 0, got {tokens}.")
    if tokens == 0:
        return 0.0
    return tokens * epsilon_per_token(lam, vocab_size)


def lambda_for_epsilon(epsilon: float, vocab_size: int, tokens: float) -> float:
    """The largest λ whose ε for ``tokens`` sampled tokens over |V| = ``vocab_size`` is ≤ ``epsilon``.

    Closed form: with r = exp(ε/T), (1 + (|V| − 1)λ)/(1 − λ) = r gives λ = (r − 1)/(r − 1 + |V|).
    Rounding is corrected downwards so the λ returned never spends more than ``epsilon``.
    """
    epsilon = float(epsilon)
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise UserError(f"ε must be a finite number > 0, got {epsilon}; e.g. --eps 8.")
    if not (math.isfinite(tokens) and tokens > 0):
        raise UserError(f"The number of predicted tokens T must be > 0 to solve for λ, got {tokens}.")
    vocab_size = _check_support(vocab_size)
    if vocab_size == 1:  # a single possible output reveals nothing: any λ < 1 is 0-DP.
        raise UserError("With a support of one token there is nothing to trade off; use a larger support.")
    per_token = epsilon / tokens
    growth = math.expm1(per_token) if per_token < 700 else math.inf  # r − 1, exact for small ε/T
    lam = 1.0 / (1.0 + vocab_size / growth) if math.isfinite(growth) else 1.0
    # A huge ε/T rounds λ to 1.0 (no privacy) and any float may land a hair above the
    # budget: step down one float at a time until the spent ε is within the budget.
    while lam > 0.0 and (lam >= 1.0 or epsilon_for_lambda(lam, vocab_size, tokens) > epsilon):
        lam = math.nextafter(lam, 0.0)
    return lam


def perturbed_log_probs(logits: "torch.Tensor", lam: float, support: "torch.Tensor | None" = None) -> "torch.Tensor":
    """log q' for q = softmax(logits) over the last dimension, computed in log space.

    log q' = logaddexp(log λ + log_softmax(z), log(1 − λ) − log|V|), in float32 at least (half
    precision logits are upcast so the small uniform mass is not flushed to zero). An entry of
    ``logits`` at −inf still gets the uniform mass: the guarantee needs the full support.

    ``support`` (bool, same shape) restricts q and u to the True entries, |V| becoming their
    count per row; q' is exactly 0 outside. It must come from public information only (SPEC §5).
    """
    lam = check_lambda(lam, allow_one=True)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logits = logits.to(dtype)
    if support is None:
        log_size = torch.tensor(math.log(logits.shape[-1]), dtype=dtype, device=logits.device)
    else:
        logits = logits.masked_fill(~support, -math.inf)
        log_size = support.sum(dim=-1, keepdim=True).to(dtype).log()
    log_q = torch.log_softmax(logits, dim=-1)
    if lam == 1.0:
        return log_q
    log_uniform = (math.log1p(-lam) - log_size).expand_as(log_q)
    if lam == 0.0:
        mixed = log_uniform.clone()
    else:
        mixed = torch.logaddexp(log_q + math.log(lam), log_uniform)
    return mixed if support is None else mixed.masked_fill(~support, -math.inf)


def perturbed_log_prob_of_targets(target_log_q: "torch.Tensor", lam: float, vocab_size: int) -> "torch.Tensor":
    """log q'(y) from log q(y) of the observed tokens only: q' is entrywise in q, so an
    evaluation needs one forward pass and then this, for every λ of a sweep."""
    lam = check_lambda(lam, allow_one=True)
    if lam == 1.0:
        return target_log_q
    log_uniform = math.log1p(-lam) - math.log(_check_support(vocab_size))
    if lam == 0.0:
        return torch.full_like(target_log_q, log_uniform)
    return torch.logaddexp(target_log_q + math.log(lam), torch.full_like(target_log_q, log_uniform))
