"""FSDP2 sharding of a fine-tuning run (``train.sharding: fsdp`` under torchrun; docs/sharding.md).

The model is wrapped with ``torch.distributed.fsdp.fully_shard``, each transformer block and then the root, before
the optimizer and the engine are built on the sharded parameters (the privacy side:
``dptext.privacy.sharding.sharded``); the engine then proves itself on the sharded model, every rank together
(``dptext.privacy.proof.sharded_probe``; under a bf16 policy with the weights gathered in fp32 for the probe), except
weights stored in half precision, proven on the whole model first. Every
rank must then run the same collectives in the same order, so each logical step runs the same number of
micro-batches on every rank (the shorter ranks run empty ones), every rank evaluates, and checkpoints are written
by every rank with ``torch.distributed.checkpoint`` (``dptext.finetune.sharded_checkpoint``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from dptext.errors import UserError
from dptext.finetune.task_probe import verify_with_task
from dptext.models.modes import training_modes
from dptext.privacy import PrivacyEngine
from dptext.privacy.clipping.clipped_step import ghost_join, join_reduction
from dptext.privacy.sharding.fsdp_controls import check_ghost_supported
from dptext.privacy.sharding.fsdp_precision import half_stored


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: the model's ``_no_split_modules`` classes (Hugging Face's own
    list of blocks), else the entries of its longest ``nn.ModuleList``; a block that shares a parameter with a
    module outside it (BERT's word embeddings, tied to the masked-LM decoder) is left to the root's unit, since
    FSDP2 cannot hold one parameter in two units."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if not blocks:
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        blocks = list(max(lists, key=len)) if lists else []
    return [block for block in dict.fromkeys(blocks) if not _shares_outside(model, block)]  # a block listed twice
    # (one instance repeated in a ModuleList) is wrapped once


def _shares_outside(model: nn.Module, block: nn.Module) -> bool:
    inside = set(block.modules())
    own = {id(param) for param in block.parameters()}
    return any(id(param) in own for module in model.modules() if module not in inside
               for param in module.parameters(recurse=False))


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
    return model


# ------------------------------------------------------------------ set-up: refuse, prove, shard

def check_sharding(recipe: Any, world_size: int, probe_now: bool) -> None:
    """Refuse, before any data is read, what sharding does not keep exact."""
    privacy = recipe.privacy
    if world_size <= 1:
        raise UserError("train.sharding=fsdp shards over torchrun processes; launch with torchrun "
                        "--nproc_per_node N (N ≥ 2) or set train.sharding=none.")
    if privacy.enabled and privacy.method == "edp_sgd":
        raise UserError("eDP-SGD clips whole micro-batches per rank and is not supported with "
                        "train.sharding=fsdp; use privacy.method=dp_sgd or train.sharding=none.")
    if privacy.enabled and privacy.clipping_mode == "ghost":
        check_ghost_supported()
    if not probe_now:
        raise UserError("dptext distill does not support train.sharding=fsdp yet; set train.sharding=none.")


def proven_before_sharding(training_recipe: Any, device: torch.device, model: nn.Module) -> bool:
    """Whether the start-up probe runs on the whole model before ``fully_shard`` (``prove_then_shard``): only for
    weights stored in half precision, whose rounding the sharded probe's comparison would carry. Otherwise the
    engine on the sharded model proves itself, every rank together (``dptext.privacy.proof.sharded_probe``), a
    bf16 policy too (the probe gathers the weights as stored: ``dptext.privacy.sharding.fsdp_precision``)."""
    privacy = training_recipe.privacy
    return privacy.enabled and privacy.verify and half_stored(model) is not None


def prove_then_shard(training_recipe: Any, task: Any, model: nn.Module, device: torch.device) -> nn.Module:
    """``fully_shard``, after the start-up probe on the whole model where its weights are stored in half precision
    (``proven_before_sharding``). That probe checks the rules of each layer on this model; sharding changes
    where the weights live between passes, not what the hooks record (FSDP2 all-gathers them for every pass;
    tests/test_fsdp.py). Every rank builds the same model from the same recipe, so the first rank proves it for all
    (``on_first_rank``): the others hold no probe state and wait, and all of them refuse in the same sentence."""
    privacy = training_recipe.privacy
    if proven_before_sharding(training_recipe, device, model):
        def prove() -> None:
            trained = [p for p in model.parameters() if p.requires_grad]
            probe = PrivacyEngine(model, torch.optim.SGD(trained, lr=0.0), noise_multiplier=0.0,
                                  max_grad_norm=privacy.max_grad_norm, expected_batch_size=1, dataset_size=1,
                                  clipping_mode=privacy.clipping_mode, clipping_layout=privacy.clipping_layout,
                                  seed=0)
            try:
                verify_with_task(probe, task, model)
            finally:
                probe.detach()

        on_first_rank(prove)
    return shard_model(model, policy=mixed_precision(training_recipe.train.precision, device))


def on_first_rank(prove) -> None:
    """``prove()`` on rank 0 only; its refusal (a ``UserError``, or any error, as one sentence) is raised on every
    rank. Without a process group it simply runs."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        prove()
        return
    verdict: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            prove()
        except Exception as error:  # noqa: BLE001 - every rank must hear of it, or the others wait for ever
            verdict[0] = str(error) if isinstance(error, UserError) else (
                f"The start-up probe failed on rank 0 ({type(error).__name__}: {error}).")
            dist.broadcast_object_list(verdict, src=0)
            raise
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise UserError(verdict[0])


def mark_verified(engine: Any, autocast_dtype: Any = None) -> None:
    """The engine on the sharded model takes the verdict of the probe on the same modules before ``fully_shard``
    (``prove_then_shard``, weights stored in half precision), for the run's autocast."""
    engine.verified, engine.proven_modes = True, training_modes(engine.model)  # the flags it was proven in
    engine.proven_autocast = autocast_dtype
    engine.recorder.verified = set(engine.tracked)


# ------------------------------------------------------------------ every rank runs the same collectives

def is_sharded(training: Any) -> bool:
    return training.dist is not None and getattr(training.dist, "sharded", False)


def same_count_on_every_rank(training: Any, chunks) -> list:
    """The micro-batches of this rank, padded with empty ones to the largest count over the ranks: FSDP2 gathers
    weights in every forward and backward, so every rank must run as many (the count is not released)."""
    chunks = list(chunks)
    if not is_sharded(training):
        return chunks
    most = int(training.dist.all_reduce_max(len(chunks)))
    return chunks + [[]] * (most - len(chunks))


def empty_pass(training: Any, autocast: Any) -> None:
    """A forward and backward pass that adds nothing (a rank joining the others' collectives): on the task's
    synthetic probe batch (random ids, never a record), its loss multiplied by 0 and its recorded layer uses
    dropped before any clipping."""
    generator = torch.Generator().manual_seed(0)
    batch = {k: v.to(training.device) if isinstance(v, torch.Tensor) else v
             for k, v in training.task.probe_batch(training.model, generator, 1, 4).items()}
    with autocast:
        losses = training.task.per_example_loss(training.model, batch)
    if getattr(training.engine, "clipping_mode", None) == "ghost":
        ghost_join(training.engine, losses)  # ghost's two passes, and the others' rows of their sums kept
        return
    if losses.requires_grad:
        (losses * 0).sum().backward()
    if training.engine is not None:
        training.engine.outside_reads.clear()
        join_reduction(training.engine)  # the others' clipped sums are reduce-scattered per micro-batch: join them


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def weights_finite(training: Any) -> bool:
    """Every rank's own shard finite, agreed over the ranks (they must stop at the same step)."""
    mine = all(bool(torch.isfinite(local(p)).all()) for p in training.model.parameters() if p.requires_grad)
    return training.dist.all_reduce_max(0 if mine else 1) == 0


# ------------------------------------------------------------------ the exported model

def full_state_dict(training: Any) -> dict | None:
    """The whole model's weights on rank 0's CPU (all ranks call it), for an ordinary HF folder; None unsharded."""
    if not is_sharded(training):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(training.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@contextmanager
def as_unsharded_class(model: nn.Module):
    """The model seen as its own class while Hugging Face writes its folder (``config.architectures`` takes the
    class name, and FSDP2 renamed it ``FSDP<name>``)."""
    wrapped = type(model)
    original = next((base for base in wrapped.__bases__ if base.__name__ == wrapped.__name__[4:]), None)
    if not wrapped.__name__.startswith("FSDP") or original is None:
        yield model
        return
    model.__class__ = original
    try:
        yield model
    finally:
        model.__class__ = wrapped


def held_bytes(model: nn.Module, optimizer: Any) -> int:
    """This rank's bytes of parameters, gradients and optimizer state (the local shards of sharded ones)."""
    tensors = [local(p) for p in model.parameters()] + [local(p.grad) for p in model.parameters()
                                                       if p.grad is not None]
    tensors += [local(v) for state in optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor) and v.ndim]
    return sum(t.numel() * t.element_size() for t in tensors)
