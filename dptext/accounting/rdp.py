"""Rényi DP of the Poisson-subsampled Gaussian mechanism and its conversion to (ε, δ).

For one step with rate q and noise multiplier σ (add/remove adjacency), RDP at order α is
r(α) = log(A_α) / (α − 1) with A_α = E_{z∼N(0,σ²)}[(1 − q + q·e^{(2z−1)/(2σ²)})^α]
(Mironov, Talwar, Zhang 2019). Steps compose additively, which is how per-step noise
schedules are handled: the total is Σ_runs steps·r(α; q, σ).

* Integer α: A_α − 1 = Σ_{k≥2} C(α,k) (1−q)^{α−k} q^k (e^{(k²−k)/(2σ²)} − 1). Every term is
  positive (the k=0,1 terms of A_α sum with the binomial identity to exactly 1), so the sum
  is taken in log space without cancellation and r keeps full relative precision even for
  tiny q and large α.
* Fractional α: the two-sided series of Mironov et al. §3.3, split at z₀ where the two
  mixture components are equal. Its terms alternate in sign beyond α, so it is summed
  with signs in log space until a proven bound on the remaining terms is below 1e-10 of
  the sum, and that bound is added: truncation can only over-state r, by < 1e-9. Float
  error is absolute (~1e-16 in A_α), harmless because ε adds S·r to O(1) terms. If the
  series ever fails to converge, the chord between the neighbouring integer orders
  (log A_α is convex in α) is used instead: an upper bound, so never optimistic.
* q = 1 is the plain Gaussian mechanism, α/(2σ²) exactly.

Conversion to (ε, δ) takes the minimum over orders of the improved bound (Canonne, Kamath,
Steinke 2020; Balle et al. 2020) ε = r + log1p(−1/α) − (log δ + log α)/(α − 1), or, on
request, the classical bound ε = r − log δ / (α − 1) (Mironov 2017).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable, Literal

import numpy as np
from scipy.special import gammaln, log_ndtr, logsumexp

from dptext.accounting.events import StepRun, check_delta, group_runs

Conversion = Literal["improved", "classical"]

# Dense fractional orders find the optimum for moderate ε; the large orders matter for
# small ε and large σ. Orders 2..10 appear in the first range and use the exact integer sum.
DEFAULT_ORDERS = np.concatenate([
    np.round(np.arange(1.1, 10.95, 0.1), 1),
    np.arange(12, 65),
    [80, 96, 112, 128, 160, 192, 256, 320, 384, 512, 768, 1024],
]).astype(float)

_SERIES_CHUNK = 512
_SERIES_MAX_TERMS = 1 << 16
_SERIES_TOL = 1e-10  # relative; 1e-10 in log A is far below anything ε can show


def _log_expm1(x: np.ndarray) -> np.ndarray:
    """log(e^x − 1) for x > 0 without overflow for large x or cancellation for small x."""
    return x + np.log(-np.expm1(-x))


@lru_cache(maxsize=8)
def _integer_binomials(alphas: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(k, log C(α, k) with −inf where k > α, α broadcast over k) for k = 2..max α.

    They do not depend on q or σ, so they are computed once per set of orders.
    """
    k = np.arange(2, max(alphas) + 1)
    a = np.asarray(alphas)[:, None]
    valid = k[None, :] <= a
    a_safe = np.where(valid, a, k[None, :])  # keeps gammaln finite where masked out
    log_binom = gammaln(a_safe + 1) - gammaln(k + 1) - gammaln(a_safe - k + 1)
    return k, np.where(valid, log_binom, -np.inf), a_safe


def _log_a_minus_1_integer(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """log(A_α − 1) for integer orders, as a sum of positive terms (see module docstring)."""
    k, log_binom, a = _integer_binomials(tuple(int(x) for x in alphas))
    terms = log_binom + (a - k) * np.log1p(-q) + k * np.log(q) + _log_expm1((k * k - k) / (2 * sigma**2))
    return logsumexp(terms, axis=1)


@lru_cache(maxsize=32)
def _fractional_binomials(alphas: tuple[float, ...], start: int) -> tuple[np.ndarray, np.ndarray]:
    """(log |C(α, i)|, C(α, i) < 0) for one chunk of i: independent of q and σ, so cached."""
    alpha = np.asarray(alphas)[:, None]
    i = np.arange(start, start + _SERIES_CHUNK, dtype=float)[None, :]
    log_binom = gammaln(alpha + 1) - gammaln(i + 1) - gammaln(alpha - i + 1)
    # The factors α − m of C(α, i) turn negative once m > α, one more with each i.
    negative = (i > np.floor(alpha) + 1) & ((i - np.floor(alpha)) % 2 == 0)
    return log_binom, negative


def _log_a_fractional(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """Upper bounds, tight to 1e-10 relative, on A_α for non-integer orders (Mironov et al. §3.3), as logs.

    All orders are summed together chunk by chunk, each until its tail is provably below
    ``_SERIES_TOL`` of the sum; that tail bound is then added, so truncation can only
    over-state A_α. An order whose series has not converged within ``_SERIES_MAX_TERMS``
    terms gets nan; the caller then uses another sound upper bound.
    """
    z0 = sigma**2 * np.log(1 / q - 1) + 0.5
    log_q, log_1mq = np.log(q), np.log1p(-q)
    scale = np.full(len(alphas), -np.inf)
    total_pos, total_neg = np.zeros(len(alphas)), np.zeros(len(alphas))
    result = np.full(len(alphas), np.nan)
    pending = np.ones(len(alphas), dtype=bool)
    for start in range(0, _SERIES_MAX_TERMS, _SERIES_CHUNK):
        rows = np.flatnonzero(pending)
        log_binom, negative = (part[rows] for part in _fractional_binomials(tuple(alphas), start))
        alpha = alphas[rows, None]
        i = np.arange(start, start + _SERIES_CHUNK, dtype=float)[None, :]
        j = alpha - i
        # Φ(·) is ½·erfc(·/√2): the Gaussian mass on each side of the split point z0.
        log_s0 = (log_binom + i * log_q + j * log_1mq + (i * i - i) / (2 * sigma**2)
                  + log_ndtr((z0 - i) / sigma))
        log_s1 = (log_binom + j * log_q + i * log_1mq + (j * j - j) / (2 * sigma**2)
                  + log_ndtr((j - z0) / sigma))
        log_terms = np.logaddexp(log_s0, log_s1)
        # Keep each order's running sums in units of its largest term so far.
        new_scale = np.maximum(scale[rows], log_terms.max(axis=1))
        shrink = np.exp(scale[rows] - new_scale)
        weights = np.exp(log_terms - new_scale[:, None])
        total_pos[rows] = total_pos[rows] * shrink + np.where(negative, 0.0, weights).sum(axis=1)
        total_neg[rows] = total_neg[rows] * shrink + np.where(negative, weights, 0.0).sum(axis=1)
        scale[rows] = new_scale
        with np.errstate(invalid="ignore"):
            log_total = scale[rows] + np.log(total_pos[rows] - total_neg[rows])
        log_tail = _series_tail_bound(i[0, -1], log_terms, log_binom[:, -1], alphas[rows], z0, sigma, log_1mq)
        done = log_tail < log_total + np.log(_SERIES_TOL)
        result[rows[done]] = np.logaddexp(log_total[done], log_tail[done])
        pending[rows[done]] = False
        if not pending.any():
            break
    return result


def _series_tail_bound(last_i: float, log_terms: np.ndarray, log_binom_last: np.ndarray, alphas: np.ndarray,
                       z0: float, sigma: float, log_1mq: float) -> np.ndarray:
    """For each order, the log of a bound on the sum of all terms after ``last_i`` (inf: none yet).

    Past i = α + 1 each term decreases until its side's split point (z0 for the first
    sum, α − z0 for the second), so at most that many terms of the current size remain;
    beyond the split points every term is at most |C(α,i)|·(1−q)^α·e^{−z0²/(2σ²)}/2, and
    Σ_{i≥n}|C(α,i)| ≤ n·|C(α,n)|. This makes the stop rule a bound, not a heuristic.
    """
    remaining = np.maximum(1.0, np.maximum(z0 - last_i, alphas - z0 - last_i))
    decaying = log_terms[:, -8:].max(axis=1) + np.log(remaining)
    past_split_points = (last_i >= z0) & (last_i >= alphas - z0)
    beyond = log_binom_last + np.log(last_i) + alphas * log_1mq - z0**2 / (2 * sigma**2)
    bound = np.where(past_split_points, decaying, np.logaddexp(decaying, beyond))
    return np.where(last_i > alphas + 1, bound, np.inf)


def _log_a_interpolated(q: float, sigma: float, alpha: float) -> float:
    """An upper bound on log A_α from the neighbouring integer orders.

    log A_α is convex in α (a log-moment-generating function), so the chord between
    ⌊α⌋ and ⌈α⌉ lies above it: a sound, slightly loose substitute for the series.
    """
    low, high = np.floor(alpha), np.ceil(alpha)
    if low < 2:  # log A_1 = 0 for any mechanism
        log_a_low = 0.0
        log_a_high = float(np.logaddexp(0.0, _log_a_minus_1_integer(q, sigma, np.array([2.0]))[0]))
    else:
        both = np.logaddexp(0.0, _log_a_minus_1_integer(q, sigma, np.array([low, high])))
        log_a_low, log_a_high = float(both[0]), float(both[1])
    return log_a_low + (alpha - low) * (log_a_high - log_a_low)


@lru_cache(maxsize=4096)
def _rdp_cached(q: float, sigma: float, orders: tuple[float, ...]) -> np.ndarray:
    alphas = np.asarray(orders, dtype=float)
    if q == 1.0:
        return alphas / (2 * sigma**2)
    result = np.empty_like(alphas)
    is_int = alphas == np.round(alphas)
    if is_int.any():
        log_am1 = _log_a_minus_1_integer(q, sigma, alphas[is_int])
        result[is_int] = np.logaddexp(0.0, log_am1) / (alphas[is_int] - 1)
    if (~is_int).any():
        fractional = alphas[~is_int]
        log_a = _log_a_fractional(q, sigma, fractional)
        for k in np.flatnonzero(~np.isfinite(log_a)):
            log_a[k] = _log_a_interpolated(q, sigma, fractional[k])
        result[~is_int] = log_a / (fractional - 1)
    # RDP of a mechanism is ≥ 0; a tiny negative value is float noise of the series.
    result = np.maximum(result, 0.0)
    result.setflags(write=False)
    return result


def rdp_subsampled_gaussian(q: float, sigma: float, orders: Iterable[float] = DEFAULT_ORDERS) -> np.ndarray:
    """RDP r(α) of one Poisson-subsampled Gaussian step, for each order α > 1."""
    orders = tuple(float(a) for a in orders)
    if min(orders) <= 1:
        raise ValueError("RDP orders must be > 1")
    return _rdp_cached(float(q), float(sigma), orders)


def rdp_of_runs(runs: Iterable[StepRun], orders: Iterable[float] = DEFAULT_ORDERS) -> np.ndarray:
    """Total RDP of a sequence of step runs: additive composition over steps."""
    orders = np.asarray(tuple(orders), dtype=float)
    total = np.zeros_like(orders)
    for q, sigma, steps in group_runs(runs):
        total += steps * rdp_subsampled_gaussian(q, sigma, orders)
    return total


def epsilon_from_rdp(rdp: np.ndarray, delta: float, orders: Iterable[float] = DEFAULT_ORDERS,
                     conversion: Conversion = "improved") -> tuple[float, float]:
    """(ε, best order) for the given total RDP curve at δ."""
    delta = check_delta(delta)
    alphas = np.asarray(tuple(orders), dtype=float)
    rdp = np.asarray(rdp, dtype=float)
    if conversion == "improved":
        eps = rdp + np.log1p(-1 / alphas) - (np.log(delta) + np.log(alphas)) / (alphas - 1)
    elif conversion == "classical":
        eps = rdp - np.log(delta) / (alphas - 1)
    else:
        raise ValueError(f"unknown RDP conversion {conversion!r}")
    # Each order alone gives a valid bound, so a failed order (nan) can be skipped; none
    # left is a bug, not a privacy statement.
    if np.all(np.isnan(eps)):
        raise FloatingPointError("RDP conversion failed at every order")
    best = int(np.nanargmin(eps))
    return max(float(eps[best]), 0.0), float(alphas[best])


def rdp_epsilon(runs: Iterable[StepRun], delta: float, conversion: Conversion = "improved",
                orders: Iterable[float] = DEFAULT_ORDERS) -> tuple[float, float]:
    """(ε, best order) of a sequence of step runs at δ by RDP."""
    orders = tuple(orders)
    return epsilon_from_rdp(rdp_of_runs(runs, orders), delta, orders, conversion)
