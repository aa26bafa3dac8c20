"""Calibration: the smallest noise multiplier σ₀ that meets a target (ε, δ), per accounting method.

ε falls as σ grows, so the answer is the root of ε(σ₀) = target. It is found by bracketed
root finding (Brent) to 1e-4 relative and then moved to the safe side: the returned σ₀ is
*checked* to give ε ≤ target, and lies within ``rel_tol`` of the exact root. Method by
method, the ε that is held to the target is:

* ``rdp``  the RDP bound;
* ``prv``  the upper end of the PRV interval (``prv_bound="estimate"`` for the estimate);
* ``pld``  the PLD upper bound (``dp-accounting``, pessimistic discretisation);
* ``gdp``  the CLT approximation, so a GDP-calibrated σ is an approximation too: ``dptext account`` may show it,
  labelled, but training calibrates only with the guaranteed methods (``check_training_accountant``).

A target no σ in [SIGMA_MIN, SIGMA_MAX] can meet is a ``UserError`` in one sentence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal

from dptext.accounting.epsilon import GUARANTEED_METHODS, check_methods, compute_epsilon
from dptext.accounting.events import check_delta, check_epsilon, check_sample_rate, check_steps, steps_per_epoch_for
from dptext.accounting.gdp import gdp_epsilon_from_mu
from dptext.accounting.schedule import CONSTANT, NoiseSchedule
from dptext.errors import UserError

SIGMA_MIN = 0.01
SIGMA_MAX = 1e5
_UNSAFE = 1e9  # stands in for ε = ∞ (or "cannot be computed") so that root finding sees a sign


@dataclass(frozen=True)
class Calibration:
    method: str
    noise_multiplier: float  # σ₀: the σ of the first epoch (of every step for a constant schedule)
    epsilon: float  # the calibrated quantity at that σ₀ (≤ target)
    target_epsilon: float
    delta: float
    approximate: bool = False  # True for GDP


def check_training_accountant(method: str) -> str:
    """The accountant that calibrates and reports a training run must give guarantees (RDP, PRV upper, PLD)."""
    if method not in GUARANTEED_METHODS:
        raise UserError(f"privacy.accountant={method} is an approximation (the CLT), not a bound, so it cannot "
                        f"calibrate or report a private run; use one of {', '.join(GUARANTEED_METHODS)} "
                        "(GDP's ε is still reported beside them, labelled).")
    return method


def calibrate_noise_multiplier(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                               method: str = "rdp", schedule: NoiseSchedule = CONSTANT,
                               steps_per_epoch: int | None = None, rel_tol: float = 1e-4,
                               conversion: str = "improved", prv_bound: Literal["upper", "estimate"] = "upper",
                               prv_eps_error: float | None = None) -> Calibration:
    """σ₀ such that ``steps`` steps at rate ``sample_rate`` under ``schedule`` spend at most ``target_epsilon``."""
    method = check_methods([method])[0]
    target = check_epsilon(target_epsilon)
    delta = check_delta(delta)
    sample_rate = check_sample_rate(sample_rate)
    steps = check_steps(steps)
    steps_per_epoch = steps_per_epoch or steps_per_epoch_for(sample_rate)
    problems: list[str] = []
    seen: dict[float, float] = {}  # the root finder revisits its bracket ends; PRV makes that costly

    def epsilon_at(sigma: float) -> float:
        if sigma not in seen:
            runs = schedule.step_runs(sigma, sample_rate, steps, steps_per_epoch)
            seen[sigma] = _calibrated_epsilon(method, runs, delta, conversion, prv_bound, prv_eps_error, problems)
        return seen[sigma]

    guess = _first_guess(target, delta, sample_rate, steps, method, schedule, steps_per_epoch, conversion)
    # PRV and PLD evaluations are costly and their σ is a few percent below the RDP guess: search narrowly.
    spread = 1.03 if method in ("prv", "pld") else 1.2
    sigma = smallest_safe_sigma(lambda s: epsilon_at(s) - target, guess, rel_tol,
                                what=f"{method.upper()} ε ≤ {target:g} at δ={delta:g}", problems=problems,
                                spread=spread)
    return Calibration(method, sigma, epsilon_at(sigma), target, delta, approximate=(method == "gdp"))



def calibrate_one_mechanism(target_epsilon: float, delta: float, method: str = "rdp") -> Calibration:
    """σ of a single Gaussian mechanism (q = 1, one step): what a matrix-factorization run is (SPEC §12)."""
    return calibrate_noise_multiplier(target_epsilon, delta, 1.0, 1, method=method)

def _calibrated_epsilon(method, runs, delta, conversion, prv_bound, prv_eps_error, problems) -> float:
    result = compute_epsilon(method, runs, delta, conversion, prv_eps_error)
    value = result.upper if (method == "prv" and prv_bound == "upper") else result.epsilon
    if value is None:  # the PRV accountant could not answer: treat as unsafe, remember why
        problems.append(result.note)
        return math.inf
    return value


def _first_guess(target, delta, sample_rate, steps, method, schedule, steps_per_epoch, conversion) -> float:
    """A cheap starting point: GDP's closed form for GDP and RDP, the RDP answer for PRV."""
    if method in ("prv", "pld"):
        rdp_sigma = calibrate_noise_multiplier(target, delta, sample_rate, steps, "rdp", schedule, steps_per_epoch,
                                               rel_tol=1e-3, conversion=conversion).noise_multiplier
        return 0.97 * rdp_sigma
    # The largest μ with ε(μ) ≤ target, searched as the smallest 1/μ (ε falls as 1/μ grows).
    try:
        mu = 1.0 / smallest_safe_sigma(lambda x: gdp_epsilon_from_mu(1.0 / x, delta) - target, 1.0, 1e-3, what="")
    except UserError:
        return 1.0
    if sample_rate == 1.0:
        return min(max(math.sqrt(steps) / mu, SIGMA_MIN), SIGMA_MAX)
    # μ = q·√(S·(e^{1/σ²} − 1))  ⇔  σ = 1/√log(1 + μ²/(q²S))
    return min(max(1.0 / math.sqrt(math.log1p(mu**2 / (sample_rate**2 * steps))), SIGMA_MIN), SIGMA_MAX)


def smallest_safe_sigma(excess: Callable[[float], float], guess: float, rel_tol: float, what: str,
                        problems: list[str] | None = None, spread: float = 1.2) -> float:
    """The smallest x in [SIGMA_MIN, SIGMA_MAX] with excess(x) ≤ 0, to ``rel_tol`` relative.

    ``excess`` must decrease in x. The returned x always satisfies excess(x) ≤ 0: it is
    evaluated, not inferred from the root finder's tolerance.
    """
    # scipy loads only when a σ is calibrated (not for `dptext account --eps` tables)
    from scipy.optimize import brentq

    def f(x: float) -> float:
        value = excess(x)
        return min(value, _UNSAFE) if not math.isnan(value) else _UNSAFE

    low, high, f_low, f_high = _bracket(f, guess, what, problems or [], spread)
    if f_low <= 0 and low == SIGMA_MIN:
        return low
    root = brentq(f, low, high, xtol=1e-12, rtol=rel_tol / 4)
    candidate = min(root * (1 + rel_tol / 2), high)
    for _ in range(8):  # a flat or slightly non-monotone ε (PRV discretisation) may need a nudge
        if f(candidate) <= 0:
            return candidate
        candidate = min(candidate * (1 + rel_tol / 2), high)
    return high


def _bracket(f: Callable[[float], float], guess: float, what: str, problems: list[str], factor: float
             ) -> tuple[float, float, float, float]:
    """(low, high, f(low), f(high)) with f(low) > 0 ≥ f(high), widening from guess·factor^±1."""
    guess = min(max(guess, SIGMA_MIN), SIGMA_MAX)
    value = f(guess)
    if value > 0:
        low, f_low = guess, value
        high = guess * factor
        while (f_high := f(min(high, SIGMA_MAX))) > 0:
            if high >= SIGMA_MAX:
                reason = f" ({problems[-1]})" if problems else ""
                raise UserError(f"No noise multiplier up to {SIGMA_MAX:g} achieves {what}{reason}; "
                                "raise the target ε or δ, or lower the sampling rate or the steps.")
            low, f_low, factor = high, f_high, factor**2
            high *= factor
        return low, min(high, SIGMA_MAX), f_low, f_high
    high, f_high = guess, value
    low = guess / factor
    while (f_low := f(max(low, SIGMA_MIN))) <= 0:
        if low <= SIGMA_MIN:
            if what:
                raise UserError(f"{what} holds even at σ={SIGMA_MIN:g}, so the target gives no meaningful "
                                "privacy; choose a smaller ε.")
            return SIGMA_MIN, SIGMA_MIN, f_low, f_low
        high, f_high, factor = low, f_low, factor**2
        low /= factor
    return max(low, SIGMA_MIN), high, f_low, f_high
