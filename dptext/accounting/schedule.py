"""Noise schedules: σ_s = σ₀·d(t) where t = s // steps_per_epoch is the epoch of step s.

Kinds (the eDP-SGD decays of Dupuy et al., SPEC §4):

* ``constant``     d(t) = 1
* ``linear:τ``     d(t) = 1 / (1 + τ·t)
* ``exp:τ``        d(t) = e^{−τ·t}
* ``list:a,b,c``   d(t) = the t-th factor; the last one holds for all later epochs

Training and accounting must agree step for step, so both take σ from
``NoiseSchedule.sigma_at`` (the engine) or ``NoiseSchedule.step_runs`` (the accountant),
which are built on the same ``factor``. A decaying schedule has *less* noise later, so
its ε is larger than that of the constant σ₀; calibration solves for σ₀.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from dptext.accounting.events import StepRun, check_noise_multiplier, check_sample_rate, check_steps
from dptext.errors import UserError

ScheduleKind = Literal["constant", "linear", "exp", "list"]
SCHEDULE_HELP = ("constant, linear:TAU (σ₀/(1+τt)), exp:TAU (σ₀·e^(−τt)) or list:F1,F2,... (σ₀·F_t), "
                 "t = epoch")


@dataclass(frozen=True)
class NoiseSchedule:
    kind: ScheduleKind = "constant"
    rate: float = 0.0
    factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "linear", "exp", "list"):
            raise UserError(f"Unknown noise schedule '{self.kind}'; use {SCHEDULE_HELP}.")
        if not (math.isfinite(self.rate) and self.rate >= 0):
            raise UserError(f"The decay rate τ must be a number ≥ 0, got {self.rate!r}.")
        if self.kind == "list" and not self.factors:
            raise UserError("A list schedule needs at least one factor, e.g. list:1,0.9,0.8.")
        if any(not (math.isfinite(f) and f > 0) for f in self.factors):
            raise UserError(f"Schedule factors must be positive numbers, got {list(self.factors)}.")

    def factor(self, epoch: int) -> float:
        """d(t): the multiplier of σ₀ during epoch t (0-based)."""
        if self.kind == "linear":
            return 1.0 / (1.0 + self.rate * epoch)
        if self.kind == "exp":
            return math.exp(-self.rate * epoch)
        if self.kind == "list":
            return self.factors[min(epoch, len(self.factors) - 1)]
        return 1.0

    def sigma_at(self, base_sigma: float, step: int, steps_per_epoch: int) -> float:
        """σ for 0-based optimizer step ``step``: what the DP engine must use."""
        return base_sigma * self.factor(step // steps_per_epoch)

    def step_runs(self, base_sigma: float, sample_rate: float, steps: int, steps_per_epoch: int
                  ) -> tuple[StepRun, ...]:
        """The accounting events of ``steps`` steps: one run per epoch (σ is constant within one)."""
        check_noise_multiplier(base_sigma)
        check_sample_rate(sample_rate)
        check_steps(steps)
        if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) or steps_per_epoch < 1:
            raise UserError(f"Steps per epoch must be a whole number ≥ 1, got {steps_per_epoch!r}.")
        if self.kind == "constant":
            return (StepRun(sample_rate, base_sigma, steps),)
        runs = []
        for first in range(0, steps, steps_per_epoch):
            count = min(steps_per_epoch, steps - first)
            runs.append(StepRun(sample_rate, self.sigma_at(base_sigma, first, steps_per_epoch), count))
        return tuple(runs)

    def describe(self) -> str:
        if self.kind == "constant":
            return "constant"
        if self.kind == "list":
            return "list:" + ",".join(f"{f:g}" for f in self.factors)
        return f"{self.kind}:{self.rate:g}"


CONSTANT = NoiseSchedule()


def parse_schedule(text: str | None) -> NoiseSchedule:
    """'constant', 'linear:0.1', 'exp:0.05' or 'list:1,0.9,0.8' → a ``NoiseSchedule``."""
    if text is None or text.strip() in ("", "constant"):
        return CONSTANT
    kind, _, value = text.strip().partition(":")
    kind = {"exponential": "exp"}.get(kind, kind)
    try:
        if kind in ("linear", "exp"):
            return NoiseSchedule(kind, rate=float(value))
        if kind == "list":
            return NoiseSchedule("list", factors=tuple(float(v) for v in value.split(",") if v.strip()))
    except ValueError:
        raise UserError(f"Cannot read the noise schedule '{text}'; use {SCHEDULE_HELP}.") from None
    raise UserError(f"Unknown noise schedule '{text}'; use {SCHEDULE_HELP}.")
