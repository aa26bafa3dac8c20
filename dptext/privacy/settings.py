"""The privacy settings of a ``PrivacyEngine`` (SPEC §1): which values are accepted, that σ and C stay fixed once
the engine is built, and the description of the mechanism they make (``engine.mechanism()``, which the ledger and
``release.json`` carry). Settings that cannot change privacy (micro-batch size, dtype) are not here.
"""

from __future__ import annotations

from typing import Any

from dptext.accounting import calibrate_noise_multiplier
from dptext.accounting.calibrate import check_training_accountant
from dptext.accounting.pld import MIN_SIGMA
from dptext.errors import UserError
from dptext.privacy.clipping.plan import _check_choice, _sampling_numbers
from dptext.privacy.noise.randomness import randomness_note
from dptext.privacy.sharding.sharded import noise_site

CLIPPING_MODES = ("bookkeeping", "ghost", "per_sample")
FIXED_SETTING = ("{} is fixed when the privacy engine is built (the noise drawn, the per-step check and the "
                 "accounting all use it); build a new PrivacyEngine for another value.")
CLIPPING_LAYOUTS = ("all_layer", "per_layer")
SAMPLINGS = ("poisson", "shuffle")


def target_noise_multiplier(target_epsilon: float, delta: float, steps: int, accountant: str, sample_rate,
                            dataset_size, expected_batch_size) -> float:
    """σ such that ``steps`` steps at the engine's sampling rate spend ``target_epsilon`` at ``delta`` by
    ``accountant`` (one that gives a bound: GDP's CLT approximation is refused)."""
    check_training_accountant(accountant)
    q, _, _ = _sampling_numbers(sample_rate, dataset_size, expected_batch_size)
    return calibrate_noise_multiplier(target_epsilon, delta, q, steps, method=accountant).noise_multiplier


def fixed_setting(name: str) -> property:
    """A privacy setting readable after construction and refused on assignment (``FIXED_SETTING``)."""
    def refuse(self, value: Any) -> None:
        raise UserError(FIXED_SETTING.format(name))

    return property(lambda self: getattr(self, f"_{name}"), refuse)


def check_settings(clipping_mode: str, clipping_layout: str, sampling: str, noise_multiplier: float,
                   max_grad_norm: float, seed: Any, secure_rng: bool) -> None:
    """The constructor's settings, each refused in one sentence before anything is planned."""
    _check_choice("clipping_mode", clipping_mode, CLIPPING_MODES)
    _check_choice("clipping_layout", clipping_layout, CLIPPING_LAYOUTS)
    _check_choice("sampling", sampling, SAMPLINGS)
    if clipping_mode == "ghost" and clipping_layout == "per_layer":
        raise UserError("Ghost clipping's second backward pass applies one factor per example; use "
                        "clipping_mode='bookkeeping' (or per_sample) for per-layer clipping.")
    check_noise(noise_multiplier, max_grad_norm)
    if sampling != "poisson":
        raise UserError(f"sampling='{sampling}' is not covered by the Poisson-subsampling accountant, so its ε "
                        "would not be a guarantee; use sampling='poisson' for private training (a non-private "
                        "run may shuffle).")
    if secure_rng and seed is not None:
        raise UserError("secure_rng draws noise and sampling seeds from the operating system; drop the seed.")


def check_noise(noise_multiplier: float, max_grad_norm: float, floor: float = MIN_SIGMA) -> None:
    """σ ≥ 0 and C > 0; σ = 0 is allowed (clipping tests, recorded as no noise), but 0 < σ < ``floor`` is
    refused: ε there is astronomically large and beyond the accountants' grids (a PLD of σ = 1e-9 would need more
    memory than any machine has), as the recipe's bound on ``privacy.noise_multiplier`` says. ``floor``: the
    smallest σ whose accounted multiplier reaches ``MIN_SIGMA`` (eDP-SGD accounts z_0 / 2)."""
    if noise_multiplier < 0 or max_grad_norm <= 0:
        raise UserError("noise_multiplier must be ≥ 0 and max_grad_norm > 0.")
    if 0 < noise_multiplier < floor:
        raise UserError(f"noise_multiplier={noise_multiplier:g} is below {floor:g}, where ε is astronomically large "
                        f"and no accountant can compute it; use a noise multiplier of at least {floor:g} (or 0 to "
                        "test clipping alone).")


def describe_mechanism(engine) -> dict[str, Any]:
    """``engine.mechanism()``: what the guarantee is about — its unit, the sensitivity, where the noise is added."""
    processes, k = engine.distributed.world_size if engine.distributed else 1, engine.max_examples_per_user
    unit = {"unit": "example", "guarantee": "example-level (ε, δ); clipping unit: one example, sensitivity C"}
    if k is not None:  # the user sampler's batches: q over users, ≤ k examples each, clipped together
        unit = {"unit": "user", "max_examples_per_user": k, "guarantee": f"user-level (ε, δ); clipping unit: one "
                f"user's sampled examples (at most {k}) summed, sensitivity C; q over users"}
    return {"method": "dp_sgd", **unit, "sensitivity": engine.max_grad_norm, "processes": processes,
            "noise": "N(0, σ²C²) once per step" + (noise_site(engine.distributed) if processes > 1 else ""),
            "sampling": engine.sampling, "randomness": randomness_note(engine.root), "noise_secret": engine.root.secret,
            "clipping_verified": engine.verified,
            "clipping": "exact: the start-up probe compared it with brute-force per-example autograd" if
            engine.verified else "NOT VERIFIED: the start-up probe has not run" + (
                " (verify=False); exactness rests on the layer rules alone" if not engine.verify_first else "")}
