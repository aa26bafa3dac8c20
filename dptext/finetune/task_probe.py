"""The start-up probe run with the task's own synthetic batches and loss (shared by finetune, eDP and distill)."""

from __future__ import annotations

from typing import Any


def verify_with_task(engine: Any, task: Any, model: Any, training_dtype: Any = None) -> None:
    """The engine's start-up probe with the task's own synthetic batches (``task.probe_batch``: random ids and
    labels, never a record) and its own per-example loss, so a loss in which examples interact is refused too.
    ``training_dtype``: the run's autocast dtype (examples must not interact in it either)."""
    options = {"training_dtype": training_dtype} if training_dtype is not None else {}
    engine.verify(make_batch=lambda examples, positions, generator: task.probe_batch(model, generator, examples,
                                                                                      positions),
                  loss_fn=task.per_example_loss, **options)
