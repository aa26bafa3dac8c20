"""Figures a run writes (ROC curves, learning curves): saved as PNG atomically, like every file of a run."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from dptext.runs import atomic_write


def atomic_write_png(path: str | Path, figure: Any) -> Path:
    """Save a matplotlib figure as a PNG atomically, then close it."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    atomic_write(path, lambda handle: handle.write(buffer.getvalue()), binary=True)
    return Path(path)
