"""The (ε, δ) a finished run's model carries, read from its ``result.json``, for whatever builds on the run: a
synthetic-data teacher (``dptext synth``), a DPKD teacher, the membership audit, ``dptext account`` and the
``dptext distill`` summary (the DistilDP results collector takes a teacher row's bound from ``guaranteed_epsilon``).

A run's own ``privacy`` block describes its own DP-SGD steps. A distilled student can carry more than that: a DPKD
student learnt from a DP teacher's outputs, so its model carries the teacher's (ε, δ) plus its own (basic
composition); a student of DP synthetic data inherits the data's (ε, δ), which its ``privacy`` block already states.
Reading only the own block would let a DPKD student, reused as a teacher or audited, claim half its ε.

The ε is always an upper bound: the accountant's guaranteed number (PRV's upper bound, never its estimate; RDP's
bound where the accountant's number is missing or only an approximation)."""

from __future__ import annotations

from typing import Any

ONE_RUN = "one DP-SGD run"


def guaranteed_epsilon(privacy: dict[str, Any]) -> tuple[str, float | None]:
    """(method, ε) of a DP-SGD run's ``privacy`` block: its accountant's upper bound, else the RDP bound."""
    by_method = privacy.get("epsilon") or {}
    accountant = privacy.get("accountant")
    chosen = by_method.get(accountant) or {}
    bound = chosen.get("upper") if accountant == "prv" else chosen.get("epsilon")
    if bound is None or chosen.get("approximate"):
        return "rdp", (by_method.get("rdp") or {}).get("epsilon")
    return accountant, bound


def carried_privacy(result: dict[str, Any]) -> dict[str, Any]:
    """``{"private", "epsilon", "delta", "accountant", "composition"}`` of the model a finished run released."""
    own = result.get("privacy") or {}
    claim = result.get("privacy_claim")
    if own.get("private") and isinstance(own.get("epsilon"), dict):  # the run took DP-SGD steps of its own
        accountant, epsilon = guaranteed_epsilon(own)
        delta = own["delta"]
        if claim is not None and "student_epsilon" in claim:  # DPKD: the teacher's outputs entered every step
            teacher = claim["teacher"]
            return {"private": True, "epsilon": teacher["epsilon"] + epsilon, "delta": teacher["delta"] + delta,
                    "accountant": accountant,
                    "composition": "basic: the DPKD teacher's (ε, δ) + the student's own DP-SGD steps"}
        return {"private": True, "epsilon": epsilon, "delta": delta, "accountant": accountant,
                "composition": ONE_RUN}
    if claim is not None:  # a student of DP synthetic data (inherited) or the untrained zero-shot student
        return {"private": bool(claim.get("private")), "epsilon": claim.get("epsilon"), "delta": claim.get("delta"),
                "accountant": None, "composition": claim.get("composition") or claim.get("note")}
    return {"private": False, "epsilon": None, "delta": None, "accountant": None, "composition": "none"}


__all__ = ["ONE_RUN", "guaranteed_epsilon", "carried_privacy"]
