"""A fine-tuning run that starts from a model dptext trained (``model.name=RUN_DIR/model``): what it carries of
that model's release (``dptext.release``; docs/concepts.md).

The new run's ε is about its own training only. What the start model learnt keeps its own ε and flags: a
non-private start model takes the new run's results out of the guarantee (as a non-private teacher does a
student's), and a DP one adds the caveat ``continued_from_private_model`` (on the same records the two ε compose).
"""

from __future__ import annotations

from pathlib import Path

from dptext.release import MANIFEST, inherited_flags, read_manifest


def dptext_output_of(model_name: str | Path) -> Path | None:
    """The dptext run or synth folder a model folder lies in (a release.json in it or up to two folders above:
    ``RUN_DIR/model``, a checkpoint's export), or None for a hub name or any other folder."""
    path = Path(model_name)
    if not path.is_dir():
        return None
    for folder in [path, *list(path.absolute().parents)[:2]]:
        if (folder / MANIFEST).is_file():
            return folder
    return None


def start_model_flags(model_name: str | Path) -> list[str]:
    """What a run whose start model dptext trained carries of it: that model's own flags (as a student carries a
    teacher's: a non-private start model takes this run's results out of the guarantee) and, where it trained on
    private data with DP, ``continued_from_private_model``."""
    source = dptext_output_of(model_name)
    if source is None:
        return []
    found = read_manifest(source) or {}
    carried = inherited_flags(source)
    private = found.get("kind") == "run" and "non_private" not in found.get("flags", {})
    return carried + (["continued_from_private_model"] if private else [])
