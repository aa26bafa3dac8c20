"""The ``privacy`` section of a recipe: every setting that changes the DP guarantee or the mechanism."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from dptext.config.fields import doc


@dataclass
class PrivacyConfig:
    enabled: bool = doc(
        True, "Train with differential privacy; false gives the non-private baseline of the same recipe.")
    target_epsilon: Optional[float] = doc(8.0, "Target ε for the whole run; σ is calibrated to it.", gt=0)
    delta: Optional[float] = doc(None, "Target δ; empty means 1/(2n) for n training examples (Li et al.).", gt=0, lt=1)
    allow_large_delta: bool = doc(
        False, "Accept δ ≥ 0.1 (given, or the default 1/(2n) when n ≤ 5), refused otherwise: (ε, δ)-DP lets a run "
        "publish a record outright with probability δ, so at such a δ no ε means much. For demonstrations only; a "
        "δ ≥ 1/n is always warned about.")
    noise_multiplier: Optional[float] = doc(
        None, "Use this σ instead of calibrating from target_epsilon; at least 0.03 (below it ε is in the "
        "thousands or beyond, a run with no meaningful privacy; use privacy.enabled=false for a non-private run).",
        ge=0.03, excludes="privacy.target_epsilon")
    max_grad_norm: float = doc(0.1, "Per-example clipping norm C (Li et al. use 0.1); per user with unit=user.", gt=0)
    unit: Literal["example", "user"] = doc(
        "example", "The privacy unit ε is about: one example (record), or one user (every record with the same "
        "data.user_column value). With user, q and train.batch_size count users, each sampled user's examples are "
        "clipped together to C, and n in δ = 1/(2n) is the number of users (docs/privacy_engine.md).")
    max_examples_per_user: Optional[int] = doc(
        None, "unit=user: k, the most examples one user contributes to a step (drawn at random, independently of "
        "their content); required with unit=user and at most train.physical_batch_size.", ge=1,
        only_with=("privacy.unit", "user"))
    accountant: Literal["rdp", "prv", "pld", "gdp"] = doc(
        "rdp", "Accountant that calibrates σ and reports the run: rdp, prv (its upper bound) or pld; all four are "
        "reported, but gdp (a CLT approximation, not a bound) is refused for training.")
    sampling: Literal["poisson", "shuffle", "cyclic"] = doc(
        "poisson", "Batch sampling. poisson matches DP-SGD's accounting, cyclic (balls-in-bins, each example in "
        "one of round(n/B) bins, step t trains bin t mod P) matches mechanism=banded_mf's and blt's, and a private "
        "run refuses any other pair; a non-private baseline (enabled=false) may shuffle.")
    mechanism: Literal["dp_sgd", "banded_mf", "blt"] = doc(
        "dp_sgd", "The noise: fresh Gaussian noise each step (dp_sgd), or matrix-factorization noise (SPEC §12: "
        "step t gets (C⁻¹Z)_t for a Toeplitz strategy C optimised at start-up, mf_strategy.json): banded_mf (a "
        "b-banded C) or blt (buffered linear Toeplitz: d decaying buffers); both need sampling=cyclic; ε is that "
        "of one Gaussian mechanism, no amplification (docs/correlated_noise.md).")
    mf_bands: int = doc(
        8, "mechanism=banded_mf: the bands b of the strategy (b − 1 model-sized noise buffers); at most the "
        "steps per epoch round(n/B), the separation the sensitivity is proven for.", ge=1,
        only_with=("privacy.mechanism", "banded_mf"))
    blt_buffers: int = doc(
        4, "mechanism=blt: the buffers d of the BLT strategy (d model-sized noise buffers, whatever the steps); "
        "its ω, θ are optimised at start-up for the run's steps and participations.", ge=1, le=16,
        only_with=("privacy.mechanism", "blt"))
    blt_error: Literal["mean", "max"] = doc(
        "mean", "mechanism=blt: the error the strategy minimises, per unit of σ²: the mean squared error of the "
        "noisy prefix sums over all steps, or that of the worst (last) one.", only_with=("privacy.mechanism", "blt"))
    clipping_mode: Literal["bookkeeping", "ghost", "per_sample"] = doc(
        "bookkeeping", "How clipped sums are computed (does not change privacy): one backward pass (bookkeeping), "
        "two (ghost), or instantiated per-example gradients (per_sample, the reference).")
    clipping_layout: Literal["all_layer", "per_layer"] = doc(
        "all_layer", "One norm over the whole model, or a threshold per layer (group-wise clipping).")
    max_stored_bytes: Optional[int] = doc(
        None, "Book-keeping, long sequences: a layer whose records (input and output gradient) would hold more than "
        "this many bytes per example at data.max_length tokens takes ghost clipping's treatment (norm in its "
        "backward hook, clipped sum from a second backward pass). Empty: book-keeping for every layer; see "
        "docs/privacy_engine.md 'Long sequences' for why that is the default.", ge=0,
        only_with=("privacy.clipping_mode", "bookkeeping"))
    method: Literal["dp_sgd", "edp_sgd"] = doc(
        "dp_sgd", "DP-SGD with per-example clipping, or eDP-SGD (Dupuy et al., SPEC §4): each process's micro-batch "
        "gradient is clipped as one unit (sensitivity 2C, accounted as noise multiplier z/2); see docs/edp.md. "
        "For edp_sgd, noise_multiplier is z_0 (noise std / C), and target_epsilon calibrates z_0 for the whole "
        "decaying schedule.")
    edp_micro_batches_per_device: int = doc(
        1, "edp_sgd: clipping units (micro-batch slots) per process; an example's slot is a keyed hash of its record "
        "(never its position), so removing one record moves only its own slot. More slots = more signal per step, "
        "one backward pass each.", ge=1)
    edp_scaling: Literal["uniform", "public", "first_step"] = doc(
        "uniform", "edp_sgd: per-parameter-tensor scaling α (clip and noise in the α-scaled space): uniform α=1, "
        "measured on public examples (edp_public_path; no privacy cost), or on the first private training "
        "examples as in the paper (first_step: data-dependent, NOT covered by ε; labelled as leaking).")
    edp_public_path: Optional[str] = doc(
        None, "edp_scaling=public: file or folder of PUBLIC examples in the training data's format (read with "
        "data.dataset's reader, its train split); they must not be private data.")
    edp_public_examples: int = doc(64, "edp_sgd: examples whose mean gradient at the initial weights measures α "
                                   "(public or first_step scaling).", ge=1)
    noise_decay: Literal["none", "linear", "exponential"] = doc(
        "none", "edp_sgd: noise decay by epoch t = step // round(1/q): z_t = z_0, z_0/(1+τt) or z_0·e^(−τt).",
        only_with=("privacy.method", "edp_sgd"))
    noise_decay_rate: float = doc(0.0, "edp_sgd: the decay rate τ of noise_decay.", ge=0,
                                  only_with=("privacy.method", "edp_sgd"))
    reproducible_noise: bool = doc(
        False, "Derive the sampler and noise from train.seed so a run can be repeated exactly. Off by default: "
        "they come from a secret os.urandom root that is never written to the run directory. When on, the "
        "guarantee holds only while train.seed stays secret, and the summary, ledger and `dptext account` say so.")
    secure_rng: bool = doc(False, "Also re-seed the noise from os.urandom before every step (a leaked generator "
                           "state then predicts at most one step); a resume is then no longer bit-exact.")
    verify: bool = doc(True, "Before training, check the engine's per-example norms and clipped sums against "
                       "brute-force autograd on synthetic token ids (no private data, no privacy cost); any "
                       "mismatch stops the run naming the layer. Does not change privacy.")
