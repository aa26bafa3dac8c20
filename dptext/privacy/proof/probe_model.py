"""The model as the start-up probe holds it while it runs, and gives it back after: its precision, its all-zero
trained tensors re-drawn, and the train/eval flags the proof is about (``dptext.privacy.proof.verify``)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from dptext.errors import UserError
from dptext.models.modes import training_modes
from dptext.privacy.proof.sharded_probe import all_zero_on_every_rank, own_rows
from dptext.privacy.sharding.sharded import is_sharded


@contextmanager
def probe_precision(model: nn.Module, dtype: torch.dtype | None):
    """Floating parameters and buffers in ``dtype`` for the probe, restored after (identities kept)."""
    if dtype is None:
        yield
        return
    saved = []
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for key, tensor in store.items():
                if tensor is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                    saved.append((store, key, tensor.dtype))
                    if isinstance(tensor, nn.Parameter):
                        tensor.data = tensor.data.to(dtype)
                    else:
                        store[key] = tensor.to(dtype)
    try:
        yield
    finally:
        for store, key, original in saved:
            tensor = store[key]
            if isinstance(tensor, nn.Parameter):
                tensor.data = tensor.data.to(original)
            else:
                store[key] = tensor.to(original)


@contextmanager
def drawn_zero_parameters(params: list[nn.Parameter]):
    """Trained tensors that are all zero (LoRA's B, ReZero and adapter gates) re-drawn at random for the probe and
    restored after (identities kept): below such a gate every layer's gradient is exactly 0 on the probe's batch, so
    its rule would never be compared ("not reached"), while training moves the gate at its first step."""
    saved = []
    generator = torch.Generator().manual_seed(20240602)
    for param in params:
        if param.is_floating_point() and param.numel() and (
                all_zero_on_every_rank(param, _all_zero) if is_sharded(param) else _all_zero(param.detach())):
            # a matrix at the usual init scale (1/√fan-in: LoRA's B over its rank); a vector (a bias, a gate) at
            # 0.02, the scale of a transformer's init: biases of 1 inflate the activations until the other layers'
            # gradients fall under the comparison's floor (BitFit's BERT: every value bias "not reached")
            scale = param.shape[-1] ** -0.5 if param.ndim > 1 else 0.02
            drawn = torch.randn(param.shape, generator=generator, dtype=torch.float64) * scale
            if is_sharded(param):  # every rank draws the whole tensor alike and writes its own rows in place
                mine = own_rows(drawn, param, torch.distributed.get_rank(), torch.distributed.get_world_size())
                with torch.no_grad():
                    saved.append((param, param.to_local().clone()))
                    param.to_local().copy_(mine)
                continue
            saved.append((param, param.data))
            param.data = drawn.to(device=param.device, dtype=param.dtype)
    try:
        yield
    finally:
        for param, data in saved:
            if is_sharded(param):
                with torch.no_grad():
                    param.to_local().copy_(data)
            else:
                param.data = data


def _all_zero(tensor: torch.Tensor) -> bool:
    """Whether every entry is 0; a nonzero entry among 4,096 spread ones answers without reading the rest (the
    whole scan read every weight of the model once, ~0.3 s of the probe at 246M parameters)."""
    if tensor.is_contiguous() and bool(tensor.view(-1)[::max(1, tensor.numel() // 4096)].any()):
        return False
    return not bool(tensor.any())


def needs_proof(engine) -> bool:
    """Whether a training forward must be proven first: never proven, proven in other train/eval flags (a proof
    adopted from before ``fully_shard`` carries its flags too), or under another autocast than this forward's (its
    re-draws in the training precision ran without it: session-26 red team, ``verify()`` then training under bf16
    autocast). Flags changed inside a logical batch are refused: a proof then would add its synthetic sums to the
    batch's."""
    if not engine.verified:
        return True
    same_modes = engine.proven_modes is None or engine.proven_modes == training_modes(engine.model)
    if same_modes and autocast_now(engine) == getattr(engine, "proven_autocast", None):
        return False
    if engine.dp_optimizer.in_logical_batch():
        raise UserError("The model's train/eval flags or its autocast changed inside a logical batch (a forward that "
                        "calls .eval() or .train() on part of the model, or one micro-batch under torch.autocast and "
                        "another not); change them between steps, so that the start-up probe proves the new forward "
                        "before its first batch.")
    return True


def autocast_now(engine):
    """The autocast dtype active for the engine's device now, or None."""
    kind = engine.params[0].device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
