"""Privacy accounting for DP-SGD: pure numerics, no torch (SPEC §3).

The mechanism is the Poisson-subsampled Gaussian (add/remove adjacency) with sampling
rate q and noise multiplier σ per step; a run is a sequence of ``StepRun``s.

* ``rdp``        Rényi DP, own implementation; improved (default) or classical conversion.
* ``gdp``        Gaussian DP with the Poisson CLT: an approximation, labelled as such.
* ``prv``        PRV accountant (``prv-accountant``): ε with lower / upper bounds.
* ``epsilon``    ε by each method as one ``EpsilonResult`` type.
* ``calibrate``  σ for a target (ε, δ), by bracketed root finding to 1e-4 relative.
* ``schedule``   noise schedules (constant, linear, exponential decay by epoch, list).
* ``ledger``     ``PrivacyLedger``: what a training run appends to and saves.
* ``plan``       recipe / command-line options → (q, steps, δ); σ per shipped recipe.
* ``curve``      ε against steps, per method.
* ``banded_mf``  correlated noise (SPEC §12): strategy matrices, sensitivity under (k, b)-participation, ε
                 of the one Gaussian mechanism a matrix-factorization run is.
* ``mf_strategy`` banded Toeplitz coefficients minimising the prefix-sum error, optimised in seconds.
* ``blt``        buffered linear Toeplitz strategies: structure, C⁻¹, exact min-separation sensitivity (SPEC §12).
* ``blt_strategy`` BLT parameters (ω, θ) minimising the mean or max prefix-sum error, optimised in seconds.
"""

from dptext.accounting.calibrate import Calibration, calibrate_noise_multiplier
from dptext.accounting.epsilon import METHODS, EpsilonResult, compute_all, compute_epsilon
from dptext.accounting.events import StepRun, default_delta, resolve_delta, steps_for_epochs
from dptext.accounting.ledger import PrivacyLedger, epsilon_unit
from dptext.accounting.plan import PrivacyPlan, plan_for_recipe
from dptext.accounting.schedule import CONSTANT, NoiseSchedule, parse_schedule

__all__ = [
    "METHODS", "CONSTANT", "Calibration", "EpsilonResult", "NoiseSchedule", "PrivacyLedger", "PrivacyPlan",
    "StepRun", "calibrate_noise_multiplier", "compute_all", "compute_epsilon", "default_delta", "epsilon_unit",
    "parse_schedule", "plan_for_recipe", "resolve_delta", "steps_for_epochs",
]
