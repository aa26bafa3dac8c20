"""The privacy ledger: every DP step a run has taken, saved in its run directory.

Training appends one entry per optimizer step — the sampling rate q and the noise
multiplier σ that step *actually used* (for eDP-SGD, the effective σ after the 2C
sensitivity correction) — and the ledger can say at any time how much ε has been spent,
by each method. Consecutive identical steps are stored as one run, so the ledger of a
million-step run is a few lines of JSON. Resuming restores it and keeps appending, so a
resumed run continues the same account instead of starting a new one.

Usage::

    from dptext.accounting.ledger import PrivacyLedger

    ledger = PrivacyLedger(delta=None, dataset_size=n, accountant="rdp")  # δ = 1/(2n), stated in delta_source
    # (from a plan: PrivacyLedger(plan.delta, n, accountant, delta_source=plan.delta_source))
    engine = PrivacyEngine(model, optimizer, ..., ledger=ledger.record_step)  # called after every noisy step
    # (or by hand: ledger.record_step(sample_rate=q, noise_multiplier=sigma))
    progress.advance(eps=ledger.epsilon_spent())        # RDP is cached: cheap every step
    run.save_ledger(ledger.to_dict())                   # with each checkpoint

    ledger = PrivacyLedger.from_dict(run.load_ledger())  # on --resume: the same account continues

``to_dict()`` holds q, σ per run, S, δ (and where it came from), the accountant, and ε by
every method at save time (recomputed, never trusted, by ``from_dict``).
"""

from __future__ import annotations

from typing import Any, Sequence

from dptext.accounting.epsilon import METHODS, EpsilonResult, check_methods, compute_all, compute_epsilon
from dptext.accounting.events import StepRun, resolve_delta, total_steps
from dptext.errors import UserError

LEDGER_FORMAT = 1
# matrix-factorization mechanisms (SPEC §12): the whole run is one Gaussian mechanism of multiplier σ/sens(C), for
# the cyclic schema their sampler enforces
CORRELATED_MECHANISMS = ("banded_mf", "blt")


def epsilon_unit(mechanism: dict[str, Any] | None) -> str:
    """Whom one ε is about, from a mechanism's description: "per user (≤ k examples each)" or "per example"."""
    if (mechanism or {}).get("unit") == "user":
        return f"per user (≤ {mechanism['max_examples_per_user']} examples each)"
    return "per example"


class PrivacyLedger:
    """An append-only account of DP-SGD steps with ε per method."""

    def __init__(self, delta: float | None = None, dataset_size: int | None = None, accountant: str = "rdp",
                 runs: Sequence[StepRun] = (), delta_source: str | None = None,
                 mechanism: dict[str, Any] | None = None):
        """``delta_source`` overrides the stated origin of δ, e.g. ``PrivacyPlan.delta_source``; ``mechanism``
        (plain data, saved as is) says what was accounted, e.g. eDP-SGD's unit, sensitivity and schedule."""
        self.delta, self.delta_source = resolve_delta(delta, dataset_size)
        self.delta_source = delta_source or self.delta_source
        self.dataset_size = dataset_size
        self.accountant = check_methods([accountant])[0]
        self.mechanism = mechanism
        self._runs: list[StepRun] = []
        for run in runs:
            self.record_steps(run.sample_rate, run.noise_multiplier, run.steps)

    # ------------------------------------------------------------------ recording
    def record_step(self, sample_rate: float, noise_multiplier: float) -> None:
        """Account one optimizer step taken with rate q and noise multiplier σ."""
        self.record_steps(sample_rate, noise_multiplier, 1)

    def record_steps(self, sample_rate: float, noise_multiplier: float, steps: int) -> None:
        """Account ``steps`` identical steps at once."""
        run = StepRun(float(sample_rate), float(noise_multiplier), steps)  # validates
        if not steps:
            return
        last = self._runs[-1] if self._runs else None
        if last and (last.sample_rate, last.noise_multiplier) == (run.sample_rate, run.noise_multiplier):
            self._runs[-1] = StepRun(last.sample_rate, last.noise_multiplier, last.steps + steps)
        else:
            self._runs.append(run)

    @property
    def runs(self) -> tuple[StepRun, ...]:
        return tuple(self._runs)

    @property
    def steps(self) -> int:
        return total_steps(self._runs)

    # ------------------------------------------------------------------ ε
    def accounted_runs(self) -> list[StepRun]:
        """What ε is computed from: the recorded DP-SGD steps or, for a matrix-factorization run (SPEC §12),
        the one Gaussian mechanism of multiplier σ/sens(C) it is, charged in full from its first step."""
        mechanism = self.mechanism or {}
        if mechanism.get("method") not in CORRELATED_MECHANISMS:
            return list(self._runs)
        sigma = float(mechanism["noise_multiplier"]) / float(mechanism["strategy_sensitivity"])
        return [StepRun(1.0, sigma, 1)] if self._runs else []

    def epsilon(self, method: str | None = None, conversion: str = "improved",
                prv_eps_error: float | None = None) -> EpsilonResult:
        """ε spent so far by ``method`` (default: the run's accountant)."""
        return compute_epsilon(method or self.accountant, self.accounted_runs(), self.delta, conversion,
                               prv_eps_error)

    def epsilon_spent(self) -> float | None:
        """The guaranteed ε spent so far by the run's accountant (RDP bound / PRV upper; GDP's approximation).

        RDP is cached per (q, σ), so asking every step costs microseconds; PRV recomposes
        (a fraction of a second), so a PRV-accounted run should ask only when it logs.
        """
        result = self.epsilon()
        return result.epsilon if result.approximate else result.guaranteed

    def report(self, methods: Sequence[str] | None = None) -> list[EpsilonResult]:
        """ε spent so far by each method (default: all three)."""
        return compute_all(self.accounted_runs(), self.delta, methods)

    # ------------------------------------------------------------------ persistence
    def to_dict(self, with_epsilon: bool = True) -> dict[str, Any]:
        """Plain data for ``RunDir.save_ledger``; ε by every method is included for readers."""
        data: dict[str, Any] = {
            "format": LEDGER_FORMAT,
            "delta": self.delta,
            "delta_source": self.delta_source,
            "dataset_size": self.dataset_size,  # n of q = B/n: users under user-level DP (see "unit")
            "unit": "user" if (self.mechanism or {}).get("unit") == "user" else "example",  # the privacy unit
            "epsilon_is": epsilon_unit(self.mechanism),
            "accountant": self.accountant,
            "steps": self.steps,
            "runs": [{"sample_rate": r.sample_rate, "noise_multiplier": r.noise_multiplier, "steps": r.steps}
                     for r in self._runs],
        }
        if self.mechanism is not None:
            data["mechanism"] = self.mechanism
        if with_epsilon:
            data["epsilon"] = {r.method: r.to_dict() for r in self.report()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "PrivacyLedger":
        """Rebuild a ledger saved by ``to_dict`` (stored ε values are ignored and recomputed)."""
        if not isinstance(data, dict) or data.get("format") != LEDGER_FORMAT or "runs" not in data:
            raise UserError("The privacy ledger is missing or not in a format this dptext reads; "
                            "check the run directory or the dptext version that wrote it.")
        try:
            runs = [StepRun(float(r["sample_rate"]), float(r["noise_multiplier"]), int(r["steps"]))
                    for r in data["runs"]]
            ledger = cls(delta=float(data["delta"]), accountant=data.get("accountant", "rdp"), runs=runs,
                         delta_source=data.get("delta_source"), mechanism=data.get("mechanism"))
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"The privacy ledger is damaged ({exc}); restore ledger.json from a checkpoint.") from None
        ledger.dataset_size = data.get("dataset_size")
        if data.get("steps", ledger.steps) != ledger.steps:
            raise UserError(f"The privacy ledger is inconsistent: it says {data['steps']} steps but its runs add up "
                            f"to {ledger.steps}; restore ledger.json from a checkpoint.")
        return ledger

    def __repr__(self) -> str:
        return f"PrivacyLedger(steps={self.steps}, runs={len(self._runs)}, delta={self.delta:g})"


__all__ = ["PrivacyLedger", "METHODS", "LEDGER_FORMAT", "epsilon_unit"]
