"""Is a model name loadable here? Answered in about a second, before any weights or downloads.

Offline aliases, tiny test models and local folders are checked on disk; a hub name is accepted when the hub
answers or the name is in the Hugging Face cache. The hub is probed once per process (or not at all under
HF_HUB_OFFLINE=1); when it is unreachable HF_HUB_OFFLINE is set, so transformers reads only its cache instead of
retrying every file for ~50 s before the real error.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

from dptext.errors import UserError
from dptext.models import CLC_MODELS, OFFLINE_MODELS, TINY_MODELS, model_source

_HUB_REACHABLE: bool | None = None  # probed once per process


def hub_reachable(timeout: float = 1.0) -> bool:
    """Whether the Hugging Face hub answers, probed once (HF_HUB_OFFLINE=1 means no without asking).

    When it does not, HF_HUB_OFFLINE is set for the rest of the process, so transformers reads only its cache
    instead of retrying the network for ~50 s per file before the real error.
    """
    global _HUB_REACHABLE
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}:
        return False
    if _HUB_REACHABLE is None:
        host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
        try:
            socket.create_connection((host, 443), timeout=timeout).close()
            _HUB_REACHABLE = True
        except OSError:
            _HUB_REACHABLE = False
            os.environ["HF_HUB_OFFLINE"] = "1"
    return _HUB_REACHABLE


def _in_hub_cache(name: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache  # huggingface_hub only when the hub cache is consulted
    except ImportError:  # pragma: no cover - transformers always brings huggingface_hub
        return False
    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # a name the hub would reject (bad characters): not cached either
        return False


def check_model_name(name: str, key: str = "model.name") -> None:
    """Refuse, in about a second and before any download, a model name that cannot load here."""
    if name in OFFLINE_MODELS or name in TINY_MODELS or name in CLC_MODELS:
        return
    aliases = ", ".join(list(OFFLINE_MODELS) + list(TINY_MODELS))
    name = os.path.expanduser(name) if name.startswith("~") else name
    if os.path.isdir(name):
        if not any(os.path.isfile(os.path.join(name, f)) for f in ("config.json", "adapter_config.json")):
            raise UserError(f"{key}: folder '{name}' holds no config.json, so it is not a saved model; pass the "
                            f"folder a run saved (RUN_DIR/model), a hub name, or an offline alias ({aliases}).")
        return
    model_source(name)  # a path-like name that does not exist is refused there
    if not hub_reachable() and not _in_hub_cache(name):
        raise UserError(f"{key}: '{name}' is neither a local folder nor in the Hugging Face cache, and the hub is "
                        f"unreachable (offline); pass a local folder or an offline alias ({aliases}).")
