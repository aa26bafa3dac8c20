"""What an eDP-SGD engine (``dptext.privacy.mechanisms.edp``) is accounted as: the mechanism's description for the
run summary and the ledger, and the floor its decaying noise may not cross (the accountants' ``MIN_SIGMA``)."""

from __future__ import annotations

from typing import Any

from dptext.accounting.pld import MIN_SIGMA
from dptext.errors import UserError
from dptext.privacy.noise.randomness import randomness_note


def check_floor(engine: Any, sigma: float, step: int) -> None:
    """Refuse a step whose accounted σ_t is below the accountants' floor (a decaying schedule reached it)."""
    if engine.noise_multiplier > 0 and not sigma >= MIN_SIGMA:
        raise UserError(f"The noise schedule {engine.schedule.describe()} brings the accounted noise multiplier to "
                        f"{sigma:.3g} at step {step}, below {MIN_SIGMA} where ε is astronomically large and no "
                        "accountant can compute it; lower privacy.noise_decay_rate or the steps, or raise z_0.")


def lowest_sigma(engine: Any, steps: int) -> tuple[float, int]:
    """The smallest accounted σ_t over steps [0, steps) and its step (the schedule is constant per epoch)."""
    starts = range(0, max(steps, 1), engine.steps_per_epoch)
    return min((engine.schedule.sigma_at(engine.accounting_noise_multiplier, s, engine.steps_per_epoch), s)
               for s in starts)


def describe(engine: Any) -> dict[str, Any]:
    """The guarantee and its unit, for the run summary and the ledger."""
    leaks = engine.scaling in ("first_step", "undeclared")
    guarantee = (f"example-level (ε, δ); clipping unit: micro-batch, sensitivity {engine.factor}C "
                 f"(accounted σ_t = z_t/{engine.factor})")
    if engine.scaling == "undeclared":
        guarantee += "; α passed without saying where it was measured (scaling=...) is NOT covered"
    elif leaks:
        guarantee += "; α measured on private data is NOT covered"
    unit = {"keyed_hash": "micro-batch (slot = keyed hash of the record id)",
            "draw_per_step": "micro-batch (slot drawn independently per example and step)"}[engine.slot_rule]
    return {"method": "edp_sgd", "unit": unit, "slot_rule": engine.slot_rule, "sampling": "poisson",
            "randomness": randomness_note(engine.root), "noise_secret": engine.root.secret,
            "sensitivity": engine.factor * engine.max_grad_norm, "sensitivity_factor": engine.factor,
            "guarantee": guarantee, "processes": engine.world_size, "micro_batches_per_device": engine.per_device,
            "slots": engine.slots, "z0": engine.noise_multiplier,
            "accounting_noise_multiplier_0": engine.accounting_noise_multiplier,
            "noise_schedule": engine.schedule.describe(), "steps_per_epoch": engine.steps_per_epoch,
            "scaling": engine.scaling, "scaling_leaks": leaks,
            "noise": "N(0, (C·z_t)²) in the scaled space once per step" + (
                " on rank 0" if engine.world_size > 1 else "") + ", then ×α_l",
            "clipping_verified": engine.verified,
            "clipping": "exact: the start-up probe compared the slot sums with brute-force autograd" if
            engine.verified else "NOT VERIFIED: the start-up probe has not run" + (
                " (verify=False); exactness rests on plain autograd alone" if not engine.verify_first else "")}
