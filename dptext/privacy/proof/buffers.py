"""What a training forward must leave alone: every buffer, and every parameter by a fingerprint (running
statistics computed from a private batch would be released without noise)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dptext.privacy.proof.sharded_probe import local_tensor


def buffer_snapshot(model: nn.Module, shard_of: dict[int, Tensor] | None = None) -> dict[str, Any]:
    """Every buffer by value, and every parameter by a fingerprint: running statistics kept in a frozen
    ``nn.Parameter`` are in the state dict too. The fingerprint (``_fingerprint``) reads no copy of the model.
    ``shard_of``: under FSDP2, the shard of each gathered parameter a module holds between passes."""
    state: dict[str, Any] = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    state.update({PARAMETER + name: _fingerprint(param) for name, param in _parameters(model, shard_of)})
    return state


def _parameters(model: nn.Module, shard_of: dict[int, Tensor] | None):
    """``model.named_parameters()``, each gathered FSDP2 parameter replaced by its shard (what persists)."""
    for name, param in model.named_parameters():
        yield name, (shard_of or {}).get(id(param), param)


PARAMETER = "\0parameter:"  # a key no buffer name can take
SAMPLED = 4096  # entries of each parameter summed for its fingerprint


def _fingerprint(param: Tensor) -> tuple:
    """What changes when a forward writes the parameter: its version counter (any in-place op on it or a
    ``detach()`` view), where its data lives (``param.data = …``) and a fp64 sum of ``SAMPLED`` evenly spaced
    entries (a write through ``param.data``, whose counter is separate; an update of every entry moves it)."""
    param = local_tensor(param.detach())  # a shard's own rows (each rank checks its own)
    flat = param.reshape(-1)
    sample = flat[::max(1, flat.numel() // SAMPLED)]
    total = float(sample.double().sum()) if param.is_floating_point() else int(sample.sum())
    return param._version, param.data_ptr(), total


def changed_buffer(model: nn.Module, before: dict[str, Any], shard_of: dict[int, Tensor] | None = None) -> str | None:
    """The first buffer or parameter a training forward changed since ``before`` (running statistics), named as
    "buffer 'x'" or "parameter 'x'", else None."""
    for name, value in model.named_buffers():
        if name not in before or value.shape != before[name].shape or not torch.equal(value, before[name]):
            return f"buffer '{name}'"
    for name, param in _parameters(model, shard_of):
        if PARAMETER + name in before and _fingerprint(param) != before[PARAMETER + name]:
            return f"parameter '{name}'"
    return None


BUFFER_CHANGED = ("{}: a training forward changes it (running statistics), so it is computed from the private "
                  "batches and released with the model without noise; put that layer in eval mode or remove it")
