"""Checkpoints of an FSDP2-sharded run (``train.sharding: fsdp``; docs/sharding.md): every rank writes and reads its
own shards of the model and the optimizer with ``torch.distributed.checkpoint``; the ordinary checkpoint
(``step-N.pt``, written by rank 0 after them) holds the sampler's, noise's and RNG states and points to the folder.
Correlated noise (banded MF, BLT) keeps per-rank filter state; it is written with the weights
(``dptext.privacy.sharding.sharded_filter``).

Resume continues bit for bit: the weights, Adam's moments and step counts come back on every rank (torch restores an
optimizer's state only for parameters that require grad, and book-keeping takes them all out of autograd, so they
are marked for the read); the rest is ``dptext.finetune.checkpointing.restore``'s, as without sharding.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dptext.errors import UserError
from dptext.privacy.sharding.sharded_filter import PREFIX, filter_state, filter_template, put_back


def weights_dir(checkpoints: Path, step: int) -> str:
    """A folder name no earlier save used: a step saved twice (a validation checkpoint, then the periodic one)
    gets ``step-N.2.dcp``, so a save never removes the folder that a written ``step-N.pt`` points to."""
    name, version = f"step-{step:08d}.dcp", 1
    while (checkpoints / name).exists():
        version += 1
        name = f"step-{step:08d}.{version}.dcp"
    return name


# The run directory's release manifest (dptext.release) classifies checkpoint files as "checkpoints/*.pt": DCP's own
# file names (__0_0.distcp, .metadata) get ".pt" appended once written, and are linked back under their own names
# into a staging folder to be read.
SUFFIX = ".pt"


def _stored_name(name: str) -> str:
    return name.lstrip(".") + SUFFIX


def save_weights(training: Any, checkpoints: Path, step: int) -> str:
    """Model and optimizer shards with ``torch.distributed.checkpoint`` (every rank writes its own), atomically:
    into a hidden staging folder that rank 0 renames once every rank has finished, under a name never used before
    (``weights_dir``). A kill before the rename leaves only the staging folder, which nothing reads. Returns the
    folder's name, which the ordinary checkpoint (written after it) points to; folders of steps whose
    ``step-N.pt`` is gone and stale staging folders are removed."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    name = training.dist.broadcast(weights_dir(checkpoints, step) if training.dist.is_writer else None)
    staging = checkpoints / f".{name}.tmp"
    if training.dist.is_writer:
        checkpoints.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier()
    state = {"model": get_model_state_dict(training.model),
             "optimizer": get_optimizer_state_dict(training.model, training.optimizer)}
    noise = filter_state(getattr(training, "engine", None))  # correlated noise: each rank's rows of its state
    if noise:
        state[PREFIX] = noise
    dcp.save(state, checkpoint_id=str(staging))
    dist.barrier()
    if training.dist.is_writer:
        for written in list(staging.iterdir()):
            written.rename(staging / _stored_name(written.name))
        os.replace(staging, checkpoints / name)
        _remove_unreferenced(checkpoints, keep=name)
    dist.barrier()
    return name


def _remove_unreferenced(checkpoints: Path, keep: str) -> None:
    """Weights folders whose step has no ``step-N.pt`` any more (pruned, or never written: a kill between the two),
    and staging folders left by a kill (no save or load is under way while rank 0 runs this)."""
    for old in checkpoints.glob("step-*.dcp"):
        step_file = checkpoints / (old.name.split(".")[0] + ".pt")
        if old.name != keep and not step_file.exists():
            shutil.rmtree(old, ignore_errors=True)
    for stale in [*checkpoints.glob(".step-*.dcp.tmp"), *checkpoints.glob(".step-*.dcp.read")]:
        shutil.rmtree(stale, ignore_errors=True)


def load_weights(training: Any, checkpoints: Path, name: str) -> None:
    """Every rank reads its shards of the model and optimizer back (``save_weights``); the resumed run then
    continues with the straight run's weights, Adam moments and step counts (tests/test_fsdp_checkpoint.py)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    folder = checkpoints / name
    metadata = folder / _stored_name(".metadata")
    if not metadata.is_file():
        raise UserError(f"The checkpoint's sharded weights {folder} are missing; resume from a complete copy of "
                        "the run directory.")
    staging = checkpoints / f".{name}.read"
    if training.dist.is_writer:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        for stored in folder.iterdir():
            original = "." + stored.name[:-len(SUFFIX)] if stored == metadata else stored.name[:-len(SUFFIX)]
            _link_or_copy(stored, staging / original)
    dist.barrier()
    saved_keys = set(dcp.FileSystemReader(str(staging)).read_metadata().state_dict_metadata)
    with all_requiring_grad(training.optimizer):
        state = {"model": get_model_state_dict(training.model),
                 "optimizer": only_saved_states(get_optimizer_state_dict(training.model, training.optimizer),
                                                saved_keys)}
        noise = filter_template(getattr(training, "engine", None), saved_keys)
        if noise:
            state[PREFIX] = noise
        dcp.load(state, checkpoint_id=str(staging))
        put_back(getattr(training, "engine", None), noise)
        set_model_state_dict(training.model, state["model"])
        # not strict: a parameter the checkpoint holds no state for (only_saved_states) is expected; it is left
        # without state (optimizer.load_state_dict replaces the fresh states), and the count check refuses any other
        # difference
        set_optimizer_state_dict(training.model, training.optimizer, state["optimizer"],
                                 options=StateDictOptions(strict=False))
    _check_optimizer_restored(training.optimizer, state["optimizer"])
    dist.barrier()
    if training.dist.is_writer:
        shutil.rmtree(staging, ignore_errors=True)


def only_saved_states(optimizer_state: dict, saved_keys: set[str]) -> dict:
    """The optimizer state to read, cut to the parameters the checkpoint holds state for. torch's
    ``get_optimizer_state_dict`` gives a fresh optimizer state for every parameter, but a parameter that had no
    gradient before the save (a non-private run: Adam skips it) has none in the checkpoint, and DCP refused the whole
    read ("Missing key in checkpoint state_dict"); such a parameter stays without state, as in the run that saved.
    Every state the checkpoint holds must find its parameter: one saved under a name this model lacks would
    otherwise be skipped, and Adam would restart on that parameter unnoticed."""
    state = {fqn: values for fqn, values in optimizer_state["state"].items()
             if any(f"optimizer.state.{fqn}.{key}" in saved_keys for key in values)}
    read = {f"optimizer.state.{fqn}.{key}" for fqn, values in state.items() for key in values}
    unread = sorted(key for key in saved_keys if key.startswith("optimizer.state.") and key not in read)
    if unread:
        raise UserError(f"The checkpoint holds optimizer state this model has no place for ({unread[0]}), so this "
                        "resume would not continue the same run; resume with the model and recipe that saved it.")
    return {**optimizer_state, "state": state}


@contextmanager
def all_requiring_grad(optimizer: Any):
    """The optimizer's parameters marked as requiring grad while a checkpoint is read: book-keeping takes every
    parameter out of autograd, and torch's ``get_optimizer_state_dict`` creates a fresh optimizer's state (which
    DCP then fills) and ``set_optimizer_state_dict`` puts it back only for parameters that require grad (it
    silently dropped every Adam moment and step count: the resumed run restarted Adam from step 0)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    flags = [p.requires_grad for p in params]
    for param in params:
        param.requires_grad_(True)
    try:
        yield
    finally:
        for param, flag in zip(params, flags):
            param.requires_grad_(flag)


def _check_optimizer_restored(optimizer: Any, saved: dict) -> None:
    """Refuse to continue when the optimizer holds state for fewer parameters than the checkpoint saved: the run
    would go on with fresh Adam moments and not continue the run that was checkpointed."""
    restored, expected = len(optimizer.state), len(saved.get("state", {}))
    if restored != expected:
        raise UserError(f"Only {restored} of the checkpoint's {expected} optimizer states were restored, so this "
                        "resume would not continue the same run; please report this bug with the run directory.")


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # a file system without hard links
        shutil.copy2(source, target)
