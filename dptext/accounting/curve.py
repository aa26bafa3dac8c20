"""ε against steps, per method: the data behind ``dptext account --plot``.

Each method is evaluated on the prefixes of the same step runs. RDP and GDP are additive
over steps, so a prefix costs one sum; PRV discretises once for the whole run
(``PrvCurve``) and composes once per point; PLD composes once per point.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dptext.accounting.epsilon import check_methods
from dptext.accounting.events import StepRun, check_delta, total_steps
from dptext.accounting.gdp import gdp_epsilon
from dptext.accounting.pld import PldOutOfRange, pld_epsilon
from dptext.accounting.prv import DEFAULT_EPS_ERROR, PrvCurve, PrvOutOfRange
from dptext.accounting.rdp import rdp_epsilon


def prefix_runs(runs: Sequence[StepRun], steps: int) -> list[StepRun]:
    """The first ``steps`` steps of ``runs``."""
    prefix, remaining = [], steps
    for run in runs:
        if remaining <= 0:
            break
        take = min(run.steps, remaining)
        prefix.append(StepRun(run.sample_rate, run.noise_multiplier, take))
        remaining -= take
    return prefix


def curve_steps(total: int, points: int = 40) -> list[int]:
    """About ``points`` step counts from 1 to ``total``, always including ``total``."""
    return sorted({int(s) for s in np.linspace(1, total, num=min(points, total))} | {total})


def epsilon_curves(runs: Sequence[StepRun], delta: float, methods: Sequence[str] | None = None,
                   points: int = 40, prv_eps_error: float | None = None) -> dict[str, dict[str, list]]:
    """{method: {"steps": [...], "epsilon": [...], "lower": [...], "upper": [...]}}; None where not computed."""
    delta = check_delta(delta)
    runs = list(runs)
    steps = curve_steps(total_steps(runs), points) if total_steps(runs) else []
    curves: dict[str, dict[str, list]] = {}
    for method in check_methods(methods):
        values: dict[str, list] = {"steps": steps, "epsilon": [], "lower": [], "upper": []}
        if method == "prv":
            try:
                prv = PrvCurve(runs, delta, DEFAULT_EPS_ERROR if prv_eps_error is None else prv_eps_error)
                bounds = [prv.epsilon(prv.counts_after(s)) for s in steps]
            except PrvOutOfRange:
                bounds = None
            values["epsilon"] = [b.estimate for b in bounds] if bounds else [None] * len(steps)
            values["lower"] = [b.lower for b in bounds] if bounds else [None] * len(steps)
            values["upper"] = [b.upper for b in bounds] if bounds else [None] * len(steps)
        elif method == "pld":  # composes once per point (~0.3 s each)
            try:
                values["epsilon"] = [pld_epsilon(prefix_runs(runs, s), delta) for s in steps]
            except PldOutOfRange:  # σ below the grid's range: not computed, as PRV out of range
                values["epsilon"] = [None] * len(steps)
            values["lower"] = values["upper"] = [None] * len(steps)
        else:
            account = rdp_epsilon if method == "rdp" else gdp_epsilon
            values["epsilon"] = [account(prefix_runs(runs, s), delta)[0] for s in steps]
            values["lower"] = values["upper"] = [None] * len(steps)
        curves[method] = values
    return curves
