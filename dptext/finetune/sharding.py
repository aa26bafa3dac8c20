"""FSDP2 sharding of a fine-tuning run (``train.sharding: fsdp`` under torchrun; docs/sharding.md).

The model is wrapped with ``torch.distributed.fsdp.fully_shard``, each transformer block and then the root, after
the start-up probe verified the engine on the whole model and before the optimizer and the engine are built on
the sharded parameters (the privacy side: ``dptext.privacy.sharded``). Every rank must then run the same
collectives in the same order, so each logical step runs the same number of micro-batches on every rank (the
shorter ranks run empty ones), every rank evaluates, and checkpoints are written by every rank with
``torch.distributed.checkpoint``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dptext.errors import UserError


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: the model's ``_no_split_modules`` classes (Hugging Face's own
    list of blocks), else the entries of its longest ``nn.ModuleList``."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def mixed_precision(precision: str, device: torch.device) -> Any:
    """FSDP2's policy for bf16: parameters all-gathered in bf16, gradients reduced in fp32 (norms are fp32
    anyway: the engine accumulates them in fp32). None for fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "fp16":
        raise UserError("train.precision=fp16 is not supported with train.sharding=fsdp; use bf16 or fp32.")
    return None


def shard_model(model: nn.Module, blocks: list[nn.Module] | None = None, policy: Any = None) -> nn.Module:
    """``fully_shard`` on each block, then on the root (which takes the remaining parameters, tied ones too)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options = {"mp_policy": policy} if policy is not None else {"mp_policy": MixedPrecisionPolicy()}
    for block in transformer_blocks(model) if blocks is None else blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    model.set_gradient_divide_factor(1.0)  # the non-private baseline's grads: Σ over ranks, divided by the count
    return model
