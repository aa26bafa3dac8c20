"""ε of a sequence of DP-SGD steps by each accountant, as one result type for every caller.

Methods and what their number means:

* ``rdp``  an upper bound (a guarantee); improved conversion unless ``conversion="classical"``.
* ``prv``  an estimate with rigorous bounds: the true ε lies in [lower, upper].
* ``pld``  privacy loss distributions (``dp-accounting``, pessimistic): a tight upper bound at every σ.
* ``gdp``  the Poisson CLT: an **approximation**, not a guarantee (exact only for q = 1).

``EpsilonResult.guaranteed`` is the number a privacy claim may rest on: the RDP bound, the
PRV upper bound, the PLD bound, and none for GDP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from dptext.accounting.events import StepRun, check_delta
from dptext.accounting.gdp import gdp_epsilon
from dptext.accounting.pld import DISCRETIZATION, PldOutOfRange, pld_epsilon
from dptext.accounting.prv import DEFAULT_EPS_ERROR, PrvOutOfRange, prv_epsilon
from dptext.accounting.rdp import rdp_epsilon
from dptext.errors import UserError

METHODS = ("rdp", "prv", "pld", "gdp")
GUARANTEED_METHODS = ("rdp", "prv", "pld")  # those that may calibrate training: their ε is an upper bound
METHOD_NOTES = {
    "rdp": "Rényi DP, upper bound",
    "pld": "privacy loss distribution (dp-accounting, pessimistic), upper bound",
    "prv": "PRV (Gopi et al. 2021); true ε in [lower, upper]",
    "gdp": "Gaussian DP via the CLT: an approximation, not a guarantee",
}


@dataclass(frozen=True)
class EpsilonResult:
    method: str
    epsilon: float | None  # the RDP bound, the PRV estimate, or the GDP approximation; None if not computed
    lower: float | None = None
    upper: float | None = None
    approximate: bool = False
    note: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def guaranteed(self) -> float | None:
        """The ε a privacy claim can rest on (None for the GDP approximation)."""
        if self.approximate:
            return None
        return self.upper if self.method == "prv" else self.epsilon

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "epsilon": self.epsilon, "lower": self.lower, "upper": self.upper,
                "approximate": self.approximate, "note": self.note, **self.detail}


def check_methods(methods: Sequence[str] | None) -> tuple[str, ...]:
    methods = tuple(methods) if methods else METHODS
    for method in methods:
        if method not in METHODS:
            raise UserError(f"Unknown accounting method '{method}'; choose from {', '.join(METHODS)}.")
    return methods


def compute_epsilon(method: str, runs: Iterable[StepRun], delta: float, conversion: str = "improved",
                    prv_eps_error: float | None = None) -> EpsilonResult:
    """ε of ``runs`` at ``delta`` by one method."""
    check_methods([method])
    delta = check_delta(delta)
    runs = list(runs)
    if method == "rdp":
        if conversion not in ("improved", "classical"):
            raise UserError(f"Unknown RDP conversion '{conversion}'; use improved or classical.")
        eps, order = rdp_epsilon(runs, delta, conversion=conversion)  # type: ignore[arg-type]
        return EpsilonResult("rdp", eps, note=f"{METHOD_NOTES['rdp']} ({conversion} conversion, order {order:g})",
                             detail={"order": order, "conversion": conversion})
    if method == "pld":
        try:
            return EpsilonResult("pld", pld_epsilon(runs, delta), note=METHOD_NOTES["pld"],
                                 detail={"discretization": DISCRETIZATION})
        except PldOutOfRange as exc:
            return EpsilonResult("pld", None, note=f"not computed, use the RDP bound: {exc}")
    if method == "gdp":
        eps, mu = gdp_epsilon(runs, delta)
        return EpsilonResult("gdp", eps, approximate=True, note=f"{METHOD_NOTES['gdp']} (μ={mu:.4g})",
                             detail={"mu": mu})
    eps_error = DEFAULT_EPS_ERROR if prv_eps_error is None else prv_eps_error
    try:
        result = prv_epsilon(runs, delta, eps_error=eps_error)
    except PrvOutOfRange as exc:
        # never a bare "not computed" (issue 16): PLD bounds ε tightly at every σ, and the reason is kept
        return EpsilonResult("prv", None, note=f"outside PRV's range, use the PLD bound: {exc}")
    note = METHOD_NOTES["prv"]
    if result.merged_noise_levels:
        note += f"; {result.merged_noise_levels} noise levels merged conservatively"
    return EpsilonResult("prv", result.estimate, lower=result.lower, upper=result.upper, note=note,
                         detail={"eps_error": eps_error, "merged_noise_levels": result.merged_noise_levels})


def compute_all(runs: Iterable[StepRun], delta: float, methods: Sequence[str] | None = None,
                conversion: str = "improved", prv_eps_error: float | None = None) -> list[EpsilonResult]:
    """ε by each of ``methods`` (default: all of METHODS), in that order."""
    runs = list(runs)
    return [compute_epsilon(m, runs, delta, conversion, prv_eps_error) for m in check_methods(methods)]
