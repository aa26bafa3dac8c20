"""A fine-tuning run that starts from a model dptext trained (``model.name=RUN_DIR/model``): what it carries of
that model's release (``dptext.release``; docs/concepts.md).

The new run's ε is about its own training only. What the start model learnt keeps its own ε and flags: a
non-private start model takes the new run's results out of the guarantee (as a non-private teacher does a
student's), and a DP one adds the caveat ``continued_from_private_model`` (on the same records the two ε compose).

The folder is found as the loader finds it (``~`` expanded) and also through a symbolic link to it (its target's
folders are looked at too); a DPTrainer's output_dir (kind ``trainer``) trained with DP as a run does, and a run
directory written before release.json existed is known by its resolved.yaml. A folder its output registers as
public (a distill student's ``student_init/``, cut from a public model) learnt nothing from the data: no flags.
A copy of ``model/`` made outside its run carries the run's flags in its ``dptext_origin.json`` (runs since
1 Dec 2026; a copy of an older run's model folder says nothing and is taken as any folder).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from dptext.release import (MANIFEST, ORIGIN, PUBLIC, REGISTRIES, UnregisteredOutput, entry_for,
                            inherited_flags, read_manifest)

RESOLVED = "resolved.yaml"  # a run directory's recipe (dptext.runs.RESOLVED), older than its release.json
TRAINED = ("run", "trainer")  # outputs whose models trained on the private data (a synth folder holds none)
TRAINER = "dptext.DPTrainer"  # the ``written_by`` of a DPTrainer's privacy.json


def _candidates(path: Path) -> list[Path]:
    """The folder and up to two above it, as named and (through symbolic links) as it really lies."""
    named, real = path.absolute(), path.resolve()
    return list(dict.fromkeys([named, *list(named.parents)[:2], real, *list(real.parents)[:2]]))


def _is_public(path: Path, source: Path, kind: str) -> bool:
    """Whether ``source``'s registry lists the model folder ``path`` as public (not learnt from the data)."""
    for folder in (path.absolute(), path.resolve()):
        if folder.is_relative_to(source) and folder != source:
            try:
                return entry_for(f"{folder.relative_to(source).as_posix()}/config.json", kind).status == PUBLIC
            except UnregisteredOutput:
                return False
    return False


def _local_folder(model_name: str | Path) -> Path | None:
    """``model_name`` as the loader finds it on disk (``~`` expanded), or None for a hub name or a missing folder."""
    name = str(model_name)
    path = Path(os.path.expanduser(name) if name.startswith("~") else name)
    return path if name and path.is_dir() else None


def dptext_output_of(model_name: str | Path) -> Path | None:
    """The dptext run, DPTrainer or synth folder a model folder lies in (a release.json, or an older run's
    resolved.yaml, in it or up to two folders above: ``RUN_DIR/model``, a checkpoint's export), or None for a hub
    name, any other folder, or a folder its output registers as public (a distill student's ``student_init/``)."""
    path = _local_folder(model_name)
    if path is None:
        return None
    for folder in _candidates(path):
        if (folder / MANIFEST).is_file() or (folder / RESOLVED).is_file():
            kind = (read_manifest(folder) or {}).get("kind", "run")
            return None if kind in REGISTRIES and _is_public(path, folder, kind) else folder
    return None


def _older_run_flags(folder: Path) -> list[str]:
    """A run directory without release.json: non_private when its recipe disabled DP or cannot be read."""
    try:
        recipe = yaml.safe_load((folder / RESOLVED).read_text()) or {}
        enabled = (recipe.get("privacy") or {}).get("enabled", True)
    except (OSError, yaml.YAMLError, AttributeError):
        enabled = False
    return [] if enabled is not False else ["non_private"]


TRAINER_REPORT = "privacy.json"  # a DPTrainer's, in its output_dir and each checkpoint-N/ (written_by says whose)


def origin_marker(model_name: str | Path) -> Path | None:
    """The ``dptext_origin.json`` a run wrote into its model folder, or the ``privacy.json`` a DPTrainer wrote into
    its output_dir and each checkpoint (``written_by``: dptext.DPTrainer), when ``model_name`` is such a folder."""
    folder = _local_folder(model_name)
    if folder is None:
        return None
    if (folder / Path(ORIGIN).name).is_file():
        return folder / Path(ORIGIN).name
    try:
        report = json.loads((folder / TRAINER_REPORT).read_text())
    except (OSError, ValueError):
        return None
    return folder / TRAINER_REPORT if isinstance(report, dict) and report.get("written_by") == TRAINER else None


def start_model_source(model_name: str | Path) -> str | None:
    """Where the start model shows that dptext trained it (its output folder, or its origin marker), or None."""
    source = dptext_output_of(model_name)
    return str(source) if source is not None else (str(origin_marker(model_name) or "") or None)


def copied_model_flags(model_name: str | Path) -> list[str]:
    """A copy of a run's ``model/`` (or of a DPTrainer's checkpoint) made outside its output: the flags its marker
    lists (``origin_marker``), as for the output itself; a marker that cannot be read counts as non-private."""
    marker = origin_marker(model_name)
    if marker is None:
        return []
    try:
        listed = json.loads(marker.read_text())["flags"]
        if not isinstance(listed, list) or not all(isinstance(flag, str) for flag in listed):
            raise ValueError(listed)
    except (OSError, ValueError, KeyError, TypeError):
        listed = ["non_private"]
    private = "non_private" not in listed
    return inherited_flags(None, listed) + (["continued_from_private_model"] if private else [])


def start_model_flags(model_name: str | Path) -> list[str]:
    """What a run whose start model dptext trained carries of it: that model's own flags (as a student carries a
    teacher's: a non-private start model takes this run's results out of the guarantee) and, where it trained on
    private data with DP, ``continued_from_private_model``."""
    source = dptext_output_of(model_name)
    if source is None:
        return copied_model_flags(model_name)
    found = read_manifest(source)
    if found is None:
        carried = _older_run_flags(source)
        private = not carried
    else:
        carried = inherited_flags(source)
        private = found.get("kind", "run") in TRAINED and "non_private" not in found.get("flags", {})
    # a marker in the folder itself holds too: a copy laid within two folders of another output (a DPTrainer's
    # output_dir='.') keeps its own flags, which that output's do not replace
    flags = list(dict.fromkeys(carried + (["continued_from_private_model"] if private else [])
                               + copied_model_flags(model_name)))
    return [flag for flag in flags if flag != "continued_from_private_model"] if "non_private" in flags else flags
