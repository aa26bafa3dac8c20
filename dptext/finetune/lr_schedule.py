"""The learning rate of each step (``train.lr_schedule``), set on the optimizer before the step.

A function of the step number and the planned step count only, so a resumed run sets the same rates as a straight
one without any scheduler state in the checkpoint, and the schedule is a public setting (no data involved).
``linear`` decays from ``train.learning_rate`` at step 1 to ``learning_rate / steps`` at the last step (never 0:
a step at rate 0 would spend privacy for nothing). A noisy DP-Adam step moves every coordinate by about the rate
in the noise's direction once the gradient signal is small, so a constant rate makes the loss drift up late in
training; the decay shrinks those late steps.
"""

from __future__ import annotations

from typing import Any


def learning_rate(base: float, schedule: str, step: int, steps: int) -> float:
    """The rate of ``step`` (1-based) of ``steps``."""
    if schedule == "constant" or steps <= 0:
        return base
    return base * (steps - step + 1) / steps  # linear: base at step 1, base/steps at the last step


def set_learning_rate(training: Any, step: int) -> None:
    cfg = training.recipe.train
    if cfg.lr_schedule == "constant":  # the optimizer keeps the rate it was built with
        return
    rate = learning_rate(cfg.learning_rate, cfg.lr_schedule, step, training.plan.steps)
    for group in training.optimizer.param_groups:
        group["lr"] = rate
