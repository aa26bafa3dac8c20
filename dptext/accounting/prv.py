"""Privacy random variables (Gopi, Lee, Wutschitz 2021) via the ``prv-accountant`` package.

The PRV accountant discretises the privacy-loss distribution of each distinct (q, σ) and
composes them numerically, so it returns ε with rigorous error bounds: the true ε lies in
[lower, upper], and ``estimate`` is its best value. ``upper`` is the guarantee that
calibration uses. Heterogeneous composition (noise schedules, changing q) is supported by
the package: each distinct (q, σ) becomes one PRV composed with itself ``steps`` times.

Every distinct (q, σ) costs one discretised distribution, so more than
``MAX_NOISE_LEVELS`` of them (e.g. a σ that changes every step) are merged into that many
groups, each accounted at its largest q and smallest σ. A mechanism with larger q and
smaller σ dominates, so the merged account is never optimistic; the result says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence
import warnings

from dptext.accounting.events import StepRun, check_delta, group_runs
from dptext.accounting.rdp import rdp_epsilon

DEFAULT_EPS_ERROR = 0.05
MAX_NOISE_LEVELS = 32
# Beyond this ε the discretised domain grows huge (minutes, gigabytes) for no useful answer.
MAX_EPSILON = 64.0


class PrvOutOfRange(ValueError):
    """The PRV accountant cannot give a useful answer here (ε far too large, δ too small)."""


@dataclass(frozen=True)
class PrvEpsilon:
    lower: float
    estimate: float
    upper: float
    merged_noise_levels: int = 0  # how many distinct (q, σ) were merged conservatively (0: none)


def merge_noise_levels(levels: Sequence[tuple[float, float, int]], limit: int
                       ) -> tuple[list[tuple[float, float, int]], dict[tuple[float, float], int]]:
    """At most ``limit`` levels (q, σ, steps), and for each original (q, σ) the index of its level.

    Levels are grouped by σ; each group is accounted at its largest q and smallest σ,
    which dominates every member, so merging never under-states ε.
    """
    if len(levels) <= limit:
        return list(levels), {(q, sigma): k for k, (q, sigma, _) in enumerate(levels)}
    by_noise = sorted(levels, key=lambda level: (level[1], -level[0]))
    merged, index = [], {}
    for k in range(limit):
        group = by_noise[round(k * len(by_noise) / limit):round((k + 1) * len(by_noise) / limit)]
        if not group:
            continue
        for q, sigma, _ in group:
            index[(q, sigma)] = len(merged)
        merged.append((max(q for q, _, _ in group), min(sigma for _, sigma, _ in group),
                       sum(n for _, _, n in group)))
    return merged, index


class PrvCurve:
    """A PRV account built once for ``runs``; ``epsilon`` also answers for any prefix of them.

    Building discretises every noise level for the full number of steps; a prefix reuses
    that discretisation (its mesh is finer than a shorter run needs), which makes an
    ε-against-steps curve cost one composition per point.
    """

    def __init__(self, runs: Iterable[StepRun], delta: float, eps_error: float = DEFAULT_EPS_ERROR):
        # prv_accountant loads only when the PRV accountant is used
        from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

        self.delta = check_delta(delta)
        self.eps_error = eps_error
        self.runs = list(runs)
        distinct = group_runs(self.runs)
        self.levels, self._level_index = merge_noise_levels(distinct, MAX_NOISE_LEVELS)
        self.merged = len(distinct) if len(self.levels) < len(distinct) else 0
        if not self.levels:
            self._accountant = None
            return
        # The RDP bound is cheap and always ≥ the truth: if it is huge, so is the domain.
        rdp_eps, _ = rdp_epsilon(self.runs, self.delta)
        if rdp_eps > MAX_EPSILON:
            raise PrvOutOfRange(f"ε is beyond {MAX_EPSILON:g} (RDP bound {rdp_eps:.3g})")
        delta_error = self.delta / 1000
        mechanisms = [PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=sigma)
                      for q, sigma, _ in self.levels]
        try:
            with warnings.catch_warnings():  # it warns that eps_max is an assumption; ours is a proven bound
                warnings.simplefilter("ignore")
                self._accountant = PRVAccountant(
                    prvs=mechanisms, max_self_compositions=[n for _, _, n in self.levels],
                    eps_error=eps_error, delta_error=delta_error,
                    eps_max=safe_domain_size(self.levels, eps_error, delta_error))
        except (ValueError, RuntimeError, OverflowError) as exc:
            # e.g. small σ (≲ 0.75): the package's discretisation check fails ("Discrete mean differs ...")
            raise PrvOutOfRange(f"the PRV accountant cannot discretise this mechanism ({exc})") from exc

    def epsilon(self, counts: Sequence[int] | None = None) -> PrvEpsilon:
        """ε bounds after ``counts[i]`` steps of each noise level (default: all of them)."""
        if self._accountant is None:
            return PrvEpsilon(0.0, 0.0, 0.0)
        counts = [n for _, _, n in self.levels] if counts is None else list(counts)
        if not any(counts):
            return PrvEpsilon(0.0, 0.0, 0.0, self.merged)
        try:
            lower, estimate, upper = self._accountant.compute_epsilon(delta=self.delta, num_self_compositions=counts)
        except (ValueError, RuntimeError, OverflowError) as exc:
            raise PrvOutOfRange(f"the PRV accountant could not resolve δ={self.delta:g} ({exc})") from exc
        if not all(math.isfinite(v) for v in (lower, estimate, upper)):
            raise PrvOutOfRange(f"the PRV accountant returned a non-finite ε at δ={self.delta:g}")
        return PrvEpsilon(max(lower, 0.0), max(estimate, 0.0), max(upper, 0.0), self.merged)

    def counts_after(self, steps: int) -> list[int]:
        """Steps of each noise level among the first ``steps`` steps of the runs."""
        counts = [0] * len(self.levels)
        remaining = steps
        for run in self.runs:
            take = min(run.steps, remaining)
            if take <= 0:
                break
            counts[self._level_index[(run.sample_rate, run.noise_multiplier)]] += take
            remaining -= take
        return counts


def safe_domain_size(levels: Sequence[tuple[float, float, int]], eps_error: float, delta_error: float) -> float:
    """Half-width L of the privacy-loss domain, by Remark 5.6 of Gopi et al. (2021).

    The package computes the same bound with its own scalar RDP code, which is most of its
    run time; any valid upper bound on ε at these δs is allowed there, and our RDP gives
    one (it is also tighter for fractional orders), so we pass L in as ``eps_max``.
    """
    total = sum(n for _, _, n in levels)
    bound, _ = rdp_epsilon([StepRun(q, sigma, n) for q, sigma, n in levels], delta_error / 4)
    for q, sigma, _ in levels:
        single, _ = rdp_epsilon([StepRun(q, sigma, 1)], delta_error / 8 / total)
        bound = max(bound, single)
    return max(bound, eps_error) + 3


def prv_epsilon(runs: Iterable[StepRun], delta: float, eps_error: float = DEFAULT_EPS_ERROR) -> PrvEpsilon:
    """ε bounds (lower, estimate, upper) of a sequence of step runs at δ by PRV."""
    return PrvCurve(runs, delta, eps_error).epsilon()
