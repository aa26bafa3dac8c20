"""What ``DPTrainer`` refuses before it touches private data: Trainer options that would break DP or its proof.

Each refusal is one sentence saying what is wrong and what to do. The Trainer's own gradient clipping is the one
option switched off rather than refused: ``max_grad_norm`` defaults to 1.0 in ``TrainingArguments``, and clipping
the noisy mean gradient again after the engine's per-example clipping would change the algorithm (not the
privacy, it is post-processing), so it is set to 0 with a warning.
"""

from __future__ import annotations

import logging
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from dptext.errors import UserError

logger = logging.getLogger(__name__)

DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU")  # accelerate's plain processes: DDP is what we replace


def without_trainer_clipping(args: Any) -> Any:
    """``args`` with ``max_grad_norm`` = 0: the engine clips each example to its own C."""
    if args.max_grad_norm and args.max_grad_norm > 0:
        logger.warning("DPTrainer turns off TrainingArguments.max_grad_norm=%s: the privacy engine clips every "
                       "example's gradient to PrivacyArguments.max_grad_norm instead.", args.max_grad_norm)
        args.max_grad_norm = 0.0  # the Trainer reads it from its own args, which is this object
    return args


def refuse_unsupported_arguments(args: Any) -> None:
    """TrainingArguments that would make the run not what the accountant covers, or that the probe does not check."""
    if args.gradient_accumulation_steps != 1:
        raise UserError("DPTrainer makes one noisy step per Poisson batch and splits it into micro-batches of "
                        "per_device_train_batch_size itself; set gradient_accumulation_steps=1 and choose the "
                        "logical batch with PrivacyArguments.expected_batch_size.")
    if args.fp16 or args.bf16:
        raise UserError("Mixed precision inside DPTrainer is not checked by the start-up probe yet; train in fp32 "
                        "(fp16=False, bf16=False).")
    if args.deepspeed:
        raise UserError("DeepSpeed (any ZeRO stage) shards or reduces gradients outside the privacy engine, so "
                        "nothing would prove them clipped and noised once; drop deepspeed, or shard with "
                        "`dptext finetune RECIPE train.sharding=fsdp` under torchrun.")
    if args.fsdp or getattr(args, "fsdp_config", None) and args.fsdp_config.get("fsdp_version"):
        raise UserError("FSDP inside DPTrainer would reduce-scatter gradients outside the privacy engine; drop the "
                        "fsdp option, or shard with `dptext finetune RECIPE train.sharding=fsdp` under torchrun.")
    if args.torch_compile:
        raise UserError("torch.compile would trace the model past the engine's hooks unchecked; set "
                        "torch_compile=False for DP training.")
    if getattr(args, "gradient_checkpointing", False) or getattr(args, "activation_checkpointing", False):
        raise UserError("Gradient checkpointing re-runs forwards inside the backward pass, which the engine's hooks "
                        "would record twice; turn activation (gradient) checkpointing off for DP training.")
    if args.label_smoothing_factor:
        raise UserError("DPTrainer's per-example losses have no label smoothing; set label_smoothing_factor=0 or "
                        "pass per_example_loss with the smoothing you want.")
    if args.auto_find_batch_size:
        raise UserError("auto_find_batch_size restarts training after an out-of-memory error, which would start a "
                        "second privacy account; set it to False and lower per_device_train_batch_size instead.")
    if args.n_gpu > 1:
        raise UserError("One process driving several GPUs (torch DataParallel) replicates the model past the "
                        "engine's hooks; launch one process per GPU with torchrun or accelerate launch.")


def refuse_unsupported_launch(accelerator: Any, parallel_sizes: dict[str, int]) -> None:
    """The launcher's set-up (accelerate config, ``accelerate launch`` flags) must be plain processes, in fp32."""
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if kind not in DISTRIBUTED_TYPES:
        raise UserError(f"DPTrainer supports plain processes (torchrun, accelerate launch without a plugin) but "
                        f"accelerate is set up for {kind}; drop that plugin from the accelerate config, or shard "
                        "with `dptext finetune RECIPE train.sharding=fsdp`.")
    if accelerator.mixed_precision != "no":
        raise UserError(f"accelerate is set up for {accelerator.mixed_precision} mixed precision, which the "
                        "start-up probe does not check yet; launch with --mixed_precision no.")
    for name, size in parallel_sizes.items():
        if size > 1:
            raise UserError(f"{name} parallelism splits examples or layers across processes outside the privacy "
                            "engine; DPTrainer supports data parallelism only.")


def refuse_gradient_reducing_wrapper(model: Any) -> None:
    """Under several processes the model must not be wrapped in DDP: its all-reduce of raw gradients would bypass
    the engine's (clipped sums all-reduced, noise once). accelerate skips DDP when no parameter requires grad,
    which book-keeping and per_sample guarantee; this checks it."""
    if isinstance(model, DistributedDataParallel):
        raise UserError("accelerate wrapped the model in DistributedDataParallel, which would all-reduce raw "
                        "gradients outside the privacy engine; use clipping_mode='bookkeeping' or 'per_sample' "
                        "with several processes.")
