"""What is accounted: runs of identical DP-SGD steps, and checks on every privacy input.

One DP-SGD step is the Poisson-subsampled Gaussian mechanism with sampling rate q and
noise multiplier σ (noise standard deviation divided by the L2 sensitivity, under
add/remove adjacency). A training run is a sequence of steps; consecutive steps with the
same (q, σ) are stored as one ``StepRun`` so that a million-step account stays small.
Composition is commutative, so accountants may regroup runs freely (``group_runs``).

The ``check_*`` functions turn bad input into a one-sentence ``UserError`` before any
numerics run: a privacy computation on a nonsensical input must never return a number.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from dptext.errors import UserError


@dataclass(frozen=True)
class StepRun:
    """``steps`` consecutive steps, each sampling with rate ``sample_rate`` and noise ``noise_multiplier``."""

    sample_rate: float
    noise_multiplier: float
    steps: int

    def __post_init__(self) -> None:
        check_sample_rate(self.sample_rate)
        check_noise_multiplier(self.noise_multiplier)
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 0:
            raise UserError(f"A step count must be a whole number ≥ 0, got {self.steps!r}.")


def group_runs(runs: Iterable[StepRun]) -> list[tuple[float, float, int]]:
    """(q, σ, total steps) for each distinct (q, σ), in first-seen order; empty runs dropped."""
    counts: Counter = Counter()
    for run in runs:
        if run.steps:
            counts[(run.sample_rate, run.noise_multiplier)] += run.steps
    return [(q, sigma, n) for (q, sigma), n in counts.items()]


def total_steps(runs: Iterable[StepRun]) -> int:
    return sum(run.steps for run in runs)


def check_sample_rate(q: float) -> float:
    if not _is_number(q) or not 0 < q <= 1:
        raise UserError(f"The sampling rate q must be in (0, 1], got {q!r}; it is batch size / dataset size.")
    return float(q)


def _positive_finite(value: float, what: str) -> float:
    if not _is_number(value) or not 0 < value < math.inf:
        raise UserError(f"{what} must be a positive number, got {value!r}.")
    return float(value)


def check_noise_multiplier(sigma: float) -> float:
    return _positive_finite(sigma, "The noise multiplier σ")


def check_delta(delta: float) -> float:
    if not _is_number(delta) or not 0 < delta < 1:
        raise UserError(f"δ must be in (0, 1), got {delta!r}; a common choice is 1/(2n) for n training examples.")
    return float(delta)


def check_epsilon(epsilon: float) -> float:
    return _positive_finite(epsilon, "The target ε")


def check_steps(steps: int) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UserError(f"The number of steps must be a whole number ≥ 1, got {steps!r}.")
    return steps


def check_dataset_size(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UserError(f"The dataset size must be a whole number ≥ 1, got {n!r}.")
    return n


def default_delta(dataset_size: int) -> float:
    """δ = 1/(2n), the default of Li et al. when a recipe gives none."""
    return 1.0 / (2 * check_dataset_size(dataset_size))


LARGE_DELTA = 0.1  # from here (ε, δ)-DP lets a run publish a record outright 1 time in 10: refused unless allowed


def check_large_delta(delta: float, delta_source: str, allowed: bool, how: str) -> None:
    """Refuse δ ≥ 0.1 (every accountant may then answer ε ≈ 0) unless ``allowed``; ``how`` says how to allow it."""
    if delta < LARGE_DELTA or allowed:
        return
    fix = ("set privacy.delta below 1/n (e.g. 1e-5) or train on more records" if delta_source.startswith("1/(2n)")
           else "use a δ below 1/n, e.g. 1e-5")
    raise UserError(f"δ = {delta:.3g} ({delta_source}) makes any ε meaningless: δ is the chance of an outright leak, "
                    f"and at δ ≥ {LARGE_DELTA:g} every accountant may answer ε = 0; {fix}, or {how} to accept it.")


def resolve_delta(delta: float | None, dataset_size: int | None, counted: str = "") -> tuple[float, str]:
    """The δ to use and where it came from, to be stated in every output (``counted``: what n counts, e.g. users)."""
    if delta is not None:
        return check_delta(delta), "given"
    if dataset_size is not None:
        n = f"{dataset_size} {counted}".strip()
        return default_delta(dataset_size), f"1/(2n) with n={n} (default when δ is not given)"
    raise UserError("No δ given and the dataset size is unknown; give δ (--delta, privacy.delta) "
                    "or the dataset size (--dataset-size) for δ = 1/(2n).")


def sample_rate_for(batch_size: int, dataset_size: int) -> float:
    """q = B / n for an expected (Poisson) batch size B."""
    check_dataset_size(dataset_size)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"The batch size must be a whole number ≥ 1, got {batch_size!r}.")
    if batch_size > dataset_size:
        raise UserError(f"The batch size {batch_size} exceeds the dataset size {dataset_size}; lower the batch size.")
    return batch_size / dataset_size


def steps_for_epochs(epochs: float, sample_rate: float) -> int:
    """Optimizer steps for ``epochs`` passes at rate q: ceil(epochs / q), the count training runs.

    Rounding up never under-counts the steps that will be taken; the small tolerance
    keeps 3 / 0.01 from becoming 301 through floating-point error.
    """
    if not _is_number(epochs) or not 0 < epochs < math.inf:
        raise UserError(f"The number of epochs must be a positive number, got {epochs!r}.")
    return max(1, math.ceil(epochs / check_sample_rate(sample_rate) - 1e-9))


def steps_per_epoch_for(sample_rate: float) -> int:
    """Whole steps per epoch, round(1/q) ≥ 1: the unit in which noise schedules decay."""
    return max(1, round(1.0 / check_sample_rate(sample_rate)))


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
