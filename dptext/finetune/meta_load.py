"""A sharded run's model built without any rank holding all of it (``train.sharding: fsdp``; docs/sharding.md).

The model is built on the ``meta`` device from its config (the classes ``load_model`` would use), sharded by
``shard_model`` (each block, then the root, with the run's policy), given empty storage with ``to_empty``, and each
rank reads only its own rows of each parameter from the folder's safetensors (``dptext.finetune.shard_fill``). What
it cannot be sure to load exactly as ``dptext.models.load_model`` does (no safetensors, GGUF aliases, tiny or
random-init models, LoRA, a task with its own model class, untied embeddings, converted checkpoint keys) is left to
today's path, which builds the whole model on every rank; one line on rank 0 says which path was taken.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dptext.adaptation import apply_adaptation
from dptext.finetune.shard_fill import (INDEX, SINGLE, Unsupported, check_shapes, checkpoint_files, fill_sharded,
                                        initialised_apart, key_map, missing_tensors)
from dptext.finetune.sharding import mixed_precision, shard_model
from dptext.models.loading import _auto_class, _missing_mlm_head
from dptext.models.offline import CLC_MODELS, OFFLINE_MODELS, TINY_MODELS, model_source
from dptext.tasks.base import Task
from dptext.tasks.classification import ClassificationTask
from dptext.tasks.infilling import InfillingTask

ADAPTATIONS = ("full", "bias", "top_n")  # they only freeze parameters of the loaded model, whole or sharded alike


def load_sharded(recipe: Any, task: Any, device: torch.device, dist: Any) -> nn.Module | None:
    """The sharded model, filled shard by shard, or None where today's path must load it (and the line says why)."""
    folder, why = _folder(recipe, task)
    if folder is not None:
        try:
            model = meta_loaded(recipe, *plain_head(task), folder, device, dist)
            _say(dist, f"each rank reads only its own rows from {folder} (meta-device build)")
            return model
        except Unsupported as reason:
            why = str(reason)
    _say(dist, f"the whole model is loaded on every rank, then sharded ({why})")
    return None


def _say(dist: Any, what: str) -> None:
    if dist.rank == 0:
        print(f"dptext: FSDP2 model loading: {what}", file=sys.stderr, flush=True)


def plain_head(task: Any) -> tuple[str, int | None] | None:
    """(head, num_labels) where the task's model is ``load_model(name, head, num_labels)`` itself; None for a task
    that builds its own model around it (mean pooling, intent-slot) or a task class not known here."""
    method = type(task).load_model
    if method is Task.load_model or method is InfillingTask.load_model:
        return task.head, task.num_labels
    if method is ClassificationTask.load_model and task.recipe.task.pooling != "mean":
        return task.head, task.num_labels
    return None


def _folder(recipe: Any, task: Any) -> tuple[Path | None, str]:
    """The local Hugging Face folder to read shard by shard, or None and why not."""
    name, adaptation = recipe.model.name, recipe.model.adaptation
    if name in TINY_MODELS or name in OFFLINE_MODELS or name in CLC_MODELS:
        return None, f"'{name}' is built in code or converted from GGUF"
    if adaptation not in ADAPTATIONS or recipe.model.untie_embeddings:
        return None, f"adaptation={adaptation}, untie_embeddings={recipe.model.untie_embeddings}"
    if plain_head(task) is None:
        return None, f"task.type={recipe.task.type} builds its own model"
    folder = Path(model_source(name))
    if not folder.is_dir():
        return None, f"'{name}' is not a local folder"
    if not ((folder / SINGLE).is_file() or (folder / INDEX).is_file()):
        return None, f"{folder} has no {SINGLE} or {INDEX}"
    if (folder / "adapter_config.json").exists():
        return None, f"{folder} holds an adapter"
    return folder, ""


def meta_model(folder: Path, head: str, num_labels: int | None) -> nn.Module:
    """The model ``load_model`` would build for ``folder``, on the meta device, in fp32 (no storage, no draws)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, **({"num_labels": num_labels} if num_labels is not None else {}))
    with torch.device("meta"):
        model = _auto_class(head).from_config(config, dtype=torch.float32)
    if model.is_custom_code():
        raise Unsupported("the model's code is custom (trust_remote_code)")
    if any(param.ndim == 0 for param in model.parameters()):
        raise Unsupported("a parameter is a scalar (FSDP2 shards rows)")
    return model.eval()


def meta_loaded(recipe: Any, head: str, num_labels: int | None, folder: Path, device: torch.device,
                dist: Any) -> nn.Module:
    """``folder``'s model with ``head``, sharded as ``recipe`` asks, each rank's rows read from the file."""
    model = meta_model(folder, head, num_labels)
    files = checkpoint_files(folder)
    found = key_map(model, list(files))
    check_shapes(model, found, files)
    params, buffers = missing_tensors(model, found)
    if head == "masked_lm" and _missing_mlm_head(sorted(params)):
        raise Unsupported("no pretrained masked-LM head (load_model refuses it)")
    apart = _same_on_every_rank(initialised_apart(meta_model(folder, head, num_labels), params, buffers), device, dist)
    model = apply_adaptation(model, recipe)  # freezes by name, before sharding as on today's path
    model.train()
    shard_model(model, policy=mixed_precision(recipe.train.precision, device))
    model.to_empty(device=device)
    fill_sharded(model, found, files, {k: v.to(device) for k, v in apart.items()}, dist.rank, dist.world_size)
    return model


def _same_on_every_rank(tensors: dict[str, torch.Tensor], device: torch.device, dist: Any) -> dict[str, torch.Tensor]:
    """Rank 0's new tensors on every rank, as today's path broadcasts rank 0's weights (small: heads, buffers)."""
    import torch.distributed as tdist

    moved = {name: tensor.to(device) for name, tensor in sorted(tensors.items())}
    if dist.active:
        for tensor in moved.values():
            tdist.broadcast(tensor, src=0)
    return moved
