"""The learning curve of a run (``eval.learning_curve``): ``learning_curve_not_private.png`` in its directory.

Left: the training loss of every logged step, read from ``diagnostics_not_private.jsonl``: an exact statistic
of the private batches that ε does not cover, hence the file's name and the panel's title. Right: the primary
metric of every evaluation (before training, periodic, final) from ``metrics.jsonl``, with the ε spent by that
step. Keep the PNG with the data; the metric and ε alone (metrics.jsonl) are covered.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dptext.figures import atomic_write_png
from dptext.runs import DIAGNOSTICS, RunDir

CURVE = "learning_curve_not_private.png"


def curve_points(run: RunDir, metric: str) -> dict[str, list]:
    """(step, loss), (step, metric) per evaluation and (step, ε) at those steps, from the run's files."""
    losses = [(r["step"], r["loss"]) for r in run.read_metrics(DIAGNOSTICS)
              if r.get("loss") is not None and "event" not in r]
    logged = run.read_metrics()
    epsilon = {r["step"]: r["epsilon"] for r in logged if r.get("epsilon") is not None}
    evaluations = [(r["step"], r[metric]) for r in logged if "split" in r and r.get(metric) is not None]
    spent = [(step, epsilon.get(step, 0.0 if step == 0 else None)) for step, _ in evaluations]
    return {"loss": losses, "metric": evaluations, "epsilon": [(s, e) for s, e in spent if e is not None]}


def write_learning_curve(run: RunDir, metric: str, title: str) -> Path:
    import matplotlib  # matplotlib loads in ~0.5 s and only runs that ask for the curve need it

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    points = curve_points(run, metric)
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
    if points["loss"]:
        left.plot(*zip(*points["loss"]), marker=".", color="tab:red")
    left.set_title("training loss per step\n(diagnostics_not_private.jsonl: NOT covered by ε)", fontsize=9)
    left.set_xlabel("step")
    left.set_ylabel("mean loss of the sampled batch")
    if points["metric"]:
        right.plot(*zip(*points["metric"]), marker="o", color="tab:blue", label=metric)
    right.set_xlabel("step")
    right.set_ylabel(metric, color="tab:blue")
    right.set_title(f"{metric} per evaluation and ε spent (metrics.jsonl)", fontsize=9)
    if points["epsilon"]:
        spent = right.twinx()
        spent.plot(*zip(*points["epsilon"]), marker="s", linestyle="--", color="tab:gray")
        spent.set_ylabel("ε spent", color="tab:gray")
    for axes in (left, right):
        axes.grid(True, alpha=0.3)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    return atomic_write_png(run.path / CURVE, figure)


def maybe_write_curve(training: Any, run: RunDir) -> None:
    recipe = training.recipe
    if recipe.eval.learning_curve:
        write_learning_curve(run, training.task.primary_metric, f"{recipe.name}: {recipe.model.name}")
