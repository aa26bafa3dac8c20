"""ROC curves of one or several audited runs on a log-scale FPR axis (the low-FPR end is what matters)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dptext.figures import atomic_write_png

STYLES = {"loss": "-", "shadow": "--", "lira": ":"}


def run_label(report: dict[str, Any]) -> str:
    privacy = report["privacy"]
    return f"ε = {privacy['epsilon']:.3g}" if privacy["private"] else "non-private"


def plot_roc(reports: list[dict[str, Any]], path: str | Path) -> Path:
    import matplotlib  # matplotlib loads in ~0.5 s and only plots need it

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt  # matplotlib loads in ~0.5 s and only plots need it

    figure, axes = plt.subplots(figsize=(6.4, 4.8), dpi=120)
    smallest = 1.0
    for number, report in enumerate(reports):
        color = f"C{number}"
        for attack, summary in report["attacks"].items():
            fpr, tpr = summary["roc"]["fpr"], summary["roc"]["tpr"]
            positive = [(f, t) for f, t in zip(fpr, tpr) if f > 0]
            if positive:
                smallest = min(smallest, positive[0][0])
            axes.plot([f for f, _ in positive], [t for _, t in positive], STYLES.get(attack, "-"), color=color,
                      label=f"{run_label(report)}, {attack} (AUC {summary['auc']:.3f})")
    floor = max(min(smallest, 1e-3), 1e-5)
    axes.plot([floor, 1], [floor, 1], color="grey", linewidth=0.8, label="chance")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlim(floor, 1)
    axes.set_ylim(floor, 1.05)
    axes.set_xlabel("false positive rate (non-members called members)")
    axes.set_ylabel("true positive rate (members found)")
    axes.set_title("Membership inference ROC", fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    return atomic_write_png(path, figure)
