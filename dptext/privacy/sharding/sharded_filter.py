"""The state of correlated noise (banded MF, BLT; ``noise/correlated.py``) in FSDP2's sharded checkpoints.

Under FSDP2 each rank keeps the filter state (banded MF: the last b − 1 noise vectors; BLT: d buffers) of the rows
it owns only, so the state is saved as the weights are: every rank writes its rows with
``torch.distributed.checkpoint``, each tensor a ``DTensor`` laid out like its parameter (``Shard(0)``), under
``noise.<parameter name>#<j>`` (j: the j-th tensor kept for it). The ordinary checkpoint keeps the rest (the keyed
stream's key and step, the strategy), which every rank holds alike. Nothing is gathered on one rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dptext.errors import UserError
from dptext.privacy.noise.correlated import FilteredNoise

PREFIX = "noise"  # the key of the filter state in the sharded checkpoint's state dict


def sharded_filter(engine: Any) -> FilteredNoise | None:
    """The engine's correlated-noise filter when it keeps sharded state; None otherwise (DP-SGD, no engine)."""
    noise = getattr(getattr(engine, "dp_optimizer", None), "noise", None)
    return noise if isinstance(noise, FilteredNoise) and noise.sharded else None


def _as_dtensor(param: nn.Parameter, flat: Tensor):
    """This rank's rows ``flat`` (the filter keeps them flat) as the local part of a tensor shaped like ``param``."""
    from torch.distributed.tensor import DTensor

    local = flat.view(param.to_local().shape)
    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())


def filter_state(engine: Any) -> dict[str, Any]:
    """What every rank writes of the filter state: ``{name#j: DTensor}``; empty without a sharded filter."""
    noise = sharded_filter(engine)
    if noise is None:
        return {}
    names = engine.param_names()
    return {f"{names[param]}#{j}": _as_dtensor(param, kept) for i, param in enumerate(noise.params)
            for j, kept in enumerate(noise.kept(i))}


def _saved_counts(saved_keys: set[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for key in saved_keys:
        if key.startswith(PREFIX + "."):
            name, j = key[len(PREFIX) + 1:].rsplit("#", 1)
            counts[name] = max(counts.get(name, 0), int(j) + 1)
    return counts


def filter_template(engine: Any, saved_keys: set[str]) -> dict[str, Any]:
    """Zeroed tensors, laid out as saved, for every filter tensor the checkpoint holds (DCP reads into them)."""
    noise = sharded_filter(engine)
    counts = _saved_counts(saved_keys)
    if noise is None:
        if counts:
            raise UserError("The checkpoint holds correlated-noise state but this run's mechanism keeps none; resume "
                            "with the recipe that saved it.")
        return {}
    names = engine.param_names()
    unknown = sorted(set(counts) - {names[param] for param in noise.params})
    if unknown:
        raise UserError(f"The checkpoint holds correlated-noise state for '{unknown[0]}', which this run does not "
                        "train; resume with the model and recipe that saved it.")
    template = {}
    for param in noise.params:
        shape = param.to_local().shape
        for j in range(counts.get(names[param], 0)):
            zeros = torch.zeros(shape.numel(), dtype=torch.float32, device=param.to_local().device)
            template[f"{names[param]}#{j}"] = _as_dtensor(param, zeros)
    return template


def put_back(engine: Any, loaded: dict[str, Any]) -> None:
    """The filter state read into ``filter_template``'s tensors, as each rank's flat rows."""
    noise = sharded_filter(engine)
    if noise is None:
        return
    names = engine.param_names()
    for i, param in enumerate(noise.params):
        tensors, j = [], 0
        while f"{names[param]}#{j}" in loaded:
            tensors.append(loaded[f"{names[param]}#{j}"].to_local().reshape(-1).clone())
            j += 1
        noise.keep(i, tensors)
