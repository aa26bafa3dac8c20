"""Fill an FSDP2-sharded model built on the meta device from a Hugging Face safetensors folder, each rank reading only
its own rows (``dptext.finetune.meta_load`` decides when; docs/sharding.md, "Memory").

Names follow ``from_pretrained``: a checkpoint key is renamed by transformers' own conversion mapping and base-model
prefix rule (``rename_source_key``). What the file lacks (a new head, non-persistent buffers such as rotary
``inv_freq``) is initialised by transformers' own ``initialize_weights`` on a second meta instance in which only
those tensors are made real: the same tensors drawn in the same order from the same generator state as
``from_pretrained`` draws them, so the values are the same bit for bit; each rank then takes its rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dptext.privacy.sharding.row_reduce import local_rows

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class Unsupported(Exception):
    """This checkpoint or model is not loaded shard by shard (today's whole-model path loads it instead)."""


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Each checkpoint key -> the safetensors file that holds it (one file, or a sharded index)."""
    from safetensors import safe_open

    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        return {key: folder / name for key, name in weight_map.items()}
    with safe_open(folder / SINGLE, framework="pt") as handle:
        return {key: folder / SINGLE for key in handle.keys()}


def tensor_names(model: nn.Module) -> dict[int, list[str]]:
    """id of each parameter -> all its names (a tied parameter has several)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def key_map(model: nn.Module, keys: list[str]) -> dict[str, str]:
    """Model name -> checkpoint key, as ``from_pretrained`` renames them; a key that a ``WeightConverter`` (fused,
    split or permuted tensors) would produce is refused: its rows are not a slice of one stored tensor."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    expected = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None) or None
    found: dict[str, str] = {}
    for key in keys:
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, expected)
        if renamed not in expected and key in expected:  # transformers' own second try: the prefix only
            renamed, pattern = rename_source_key(key, [], [], prefix, expected)
        if pattern is not None:
            raise Unsupported(f"transformers converts checkpoint key {key} (not a plain rename)")
        if renamed in expected:
            found[renamed] = key
    return found


def missing_tensors(model: nn.Module, found: dict[str, str]) -> tuple[set[str], set[str]]:
    """(parameter names none of whose tied names is in the file, buffer names to compute): what the normal loader
    initialises. A tied parameter missing under every name is refused (``from_pretrained`` marks tied weights as
    loaded and would leave it as allocated)."""
    params = set()
    for names in tensor_names(model).values():
        if not any(name in found for name in names):
            if len(names) > 1:
                raise Unsupported(f"tied parameter {names[0]} is not in the checkpoint")
            params.add(names[0])
    persistent = set(model.state_dict())
    buffers = {name for name, _ in model.named_buffers() if name not in persistent or name not in found}
    return params, buffers


def initialised_apart(reference: nn.Module, params: set[str], buffers: set[str]) -> dict[str, torch.Tensor]:
    """``params`` and ``buffers`` of ``reference`` (a meta instance from the same config) made real on the CPU and
    initialised by transformers' ``initialize_weights`` as ``from_pretrained`` does for missing keys; every other
    tensor stays on the meta device, marked initialised, so it draws nothing."""
    for name, param in list(reference.named_parameters()):
        if name in params:
            module, leaf = _owner(reference, name)
            setattr(module, leaf, nn.Parameter(torch.empty_like(param, device="cpu"), param.requires_grad))
        else:
            param._is_hf_initialized = True
    for name, buffer in list(reference.named_buffers()):
        module, leaf = _owner(reference, name)
        if name in buffers:
            module._buffers[leaf] = torch.empty_like(buffer, device="cpu")  # keeps its persistence (a set of names)
        else:
            buffer._is_hf_initialized = True
    reference.initialize_weights()
    made = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    return {name: made[name].detach() for name in params | buffers}


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def fill_sharded(model: nn.Module, found: dict[str, str], files: dict[str, Path], apart: dict[str, torch.Tensor],
                 rank: int, world_size: int) -> None:
    """Each parameter's local rows from the file (or from ``apart``), each buffer whole (they are small and not
    sharded), written into the tensors ``to_empty`` left."""
    with _Readers(files) as read, torch.no_grad():
        for names in tensor_names(model).values():
            param = model.get_parameter(names[0])
            local = param.to_local() if hasattr(param, "to_local") else param
            first, count = local_rows(param, rank, world_size) if local is not param else (0, param.shape[0])
            if local.shape[:1] != (count,):
                raise Unsupported(f"{names[0]} is not sharded by rows (dim 0)")
            key = next((found[name] for name in names if name in found), None)
            rows = apart[names[0]][first:first + count] if key is None else read.rows(key, first, count)
            local.copy_(rows)
        for name, buffer in model.named_buffers():
            buffer.copy_(apart[name] if name in apart else read.whole(found[name]))


class _Readers:
    """Open safetensors files, one handle per file, for slices by key."""

    def __init__(self, files: dict[str, Path]):
        self.files, self.handles = files, {}

    def __enter__(self) -> "_Readers":
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles.values():
            handle.__exit__(None, None, None)

    def _handle(self, key: str) -> Any:
        from safetensors import safe_open

        path = self.files[key]
        if path not in self.handles:
            self.handles[path] = safe_open(path, framework="pt").__enter__()
        return self.handles[path]

    def rows(self, key: str, first: int, count: int) -> torch.Tensor:
        """Only rows ``first`` to ``first + count`` of the stored tensor are read (and cast, as the loader casts)."""
        return self._handle(key).get_slice(key)[first:first + count]

    def whole(self, key: str) -> torch.Tensor:
        return self._handle(key).get_tensor(key)


def check_shapes(model: nn.Module, found: dict[str, str], files: dict[str, Path]) -> None:
    """Every stored tensor has the model's shape (``from_pretrained`` refuses a mismatch; so does this path)."""
    with _Readers(files) as read:
        expected = model.state_dict()
        for name, key in found.items():
            stored = list(read._handle(key).get_slice(key).get_shape())
            if stored != list(expected[name].shape):
                raise Unsupported(f"{key} is stored with shape {stored}, the model's is {list(expected[name].shape)}")
