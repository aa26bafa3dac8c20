"""Perplexity against ε, like Majmudar et al. Figure 2 (the dotted line is the non-private model)."""

from __future__ import annotations

import io
import math
from pathlib import Path

from dptext.decoding.sweep import SweepResult
from dptext.runs import atomic_write


def plot_sweep(result: SweepResult, path: str | Path, title: str = "") -> Path:
    """Write a PNG of perplexity against ε per example; λ = 1 (ε = ∞) is the dotted line."""
    import matplotlib  # matplotlib loads in ~0.5 s and only plots need it

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt  # matplotlib loads in ~0.5 s and only plots need it
    import matplotlib.ticker

    finite = [row for row in result.rows if math.isfinite(row.epsilon)]
    figure, axes = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    axes.plot([r.epsilon for r in finite], [r.perplexity for r in finite], marker="o", color="tab:blue",
              label="DP decoding (λ-perturbed sampling)")
    for row in finite:
        axes.annotate(f"λ={row.lam:g}", (row.epsilon, row.perplexity), textcoords="offset points", xytext=(4, 4),
                      fontsize=7)
    axes.axhline(result.baseline_perplexity, linestyle=":", color="black",
                 label=f"no privacy (λ=1): {result.baseline_perplexity:.3g}")
    # like the paper, a linear axis; a sweep reaching λ near 0 (perplexity → |V|) needs a log one
    values = [r.perplexity for r in finite] + [result.baseline_perplexity]
    if max(values) / min(values) > 50:
        axes.set_yscale("log")
        axes.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    axes.set_xlabel(f"ε per example (T = {result.tokens_per_example:.2f} predicted tokens, |V| = {result.vocab_size})")
    axes.set_ylabel("perplexity under q'")
    axes.set_title(title or f"Perplexity vs ε ({result.kind}, {result.examples} examples)", fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    atomic_write(path, lambda handle: handle.write(buffer.getvalue()), binary=True)
    return Path(path)
