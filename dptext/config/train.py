"""The ``train`` and ``eval`` sections of a recipe: optimisation and evaluation settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from dptext.config.fields import doc


@dataclass
class TrainConfig:
    optimizer: Literal["adam", "adamw", "sgd"] = doc(
        "adam", "Optimizer wrapped by the DP optimizer (DP-Adam by default).")
    learning_rate: float = doc(5e-4, "Learning rate.", gt=0)
    lr_schedule: Literal["constant", "linear"] = doc(
        "constant", "constant, or linear: decays from learning_rate at the first step to learning_rate/steps at "
        "the last (a public setting; keeps late noisy DP-Adam steps from drifting the loss up).")
    weight_decay: float = doc(0.0, "Weight decay (Li et al. use none).", ge=0)
    epochs: float = doc(10.0, "Training epochs (steps = epochs / sampling rate).", gt=0)
    max_steps: Optional[int] = doc(
        None, "Stop after this many optimizer steps (overrides epochs for the step count).", ge=1)
    batch_size: int = doc(1024, "Expected logical batch size B (sampling rate q = B/n).", ge=1)
    physical_batch_size: Optional[int] = doc(None, "Micro-batch size per forward pass, cut from the sampled rows "
                                             "shortest first (user-level: users by their longest row), so little "
                                             "is padding; empty picks one that fits memory. Does not change "
                                             "privacy.", ge=1)
    seed: int = doc(0, "Seed of the public random choices: initialisation, dropout (and the sampler and noise only "
                    "with privacy.reproducible_noise=true, or for a non-private run).", ge=0)
    device: str = doc("auto", "auto, cpu, cuda or cuda:N.")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = doc(
        "auto", "auto = bf16 autocast on GPU, fp32 on CPU. Norms accumulate in fp32 either way.")
    eval_every: Optional[int] = doc(None, "Evaluate every N steps (empty: only at the end).", ge=1)
    checkpoint_every: Optional[int] = doc(None, "Checkpoint every N steps (empty: only at the end).", ge=1)
    early_stopping_patience: Optional[int] = doc(
        None, "Stop after this many periodic validation evaluations (train.eval_every) without a better primary "
        "metric; empty: train every planned step. Selects on validation only, never on test; a private run "
        "stopped early reports the smaller ε of the steps it took.", ge=1)
    keep_best: bool = doc(False, "Before the final evaluation, restore the weights of the best periodic "
                          "validation evaluation (kept in best.pt; needs train.eval_every; a checkpoint follows "
                          "every evaluation).")
    log_every: int = doc(10, "Write metrics every N steps.", ge=1)
    sharding: Literal["none", "fsdp"] = doc(
        "none", "none: every torchrun rank holds the whole model; fsdp: parameters, gradients and optimizer state "
        "sharded over the ranks with FSDP2 (docs/sharding.md). Does not change privacy.")


@dataclass
class EvalConfig:
    split: Literal["validation", "test"] = doc(
        "test", "Split of the final evaluation (periodic evaluations use validation). GLUE test has no labels.")
    before_training: bool = doc(False, "Also evaluate the model before the first step, as a baseline.")
    learning_curve: bool = doc(False, "Write learning_curve_not_private.png to the run directory: the training loss "
                               "(from the not-covered diagnostics) and, per evaluation, the primary metric and ε.")
    baseline: Optional[str] = doc(None, "A committed result JSON (relative to the working directory) of the same "
                                  "recipe without privacy; the summary shows its metrics beside the run's.")
    beam_size: int = doc(5, "Beam size for generation tasks.", ge=1)
    max_new_tokens: int = doc(64, "Maximum generated tokens per example.", ge=1)
    batch_size: int = doc(32, "Evaluation batch size.", ge=1)
