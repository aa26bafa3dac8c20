"""What ``DPTrainer`` refuses before it touches private data: Trainer options that would break DP or its proof.

Each refusal is one sentence saying what is wrong and what to do. The Trainer's own gradient clipping is the one
option switched off rather than refused: ``max_grad_norm`` defaults to 1.0 in ``TrainingArguments``, and clipping
the noisy mean gradient again after the engine's per-example clipping would change the algorithm (not the
privacy, it is post-processing), so it is set to 0 with a warning.
"""

from __future__ import annotations

import hashlib
import logging
import math
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from dptext.accounting.events import check_epsilon
from dptext.accounting.pld import MIN_SIGMA
from dptext.errors import UserError
from dptext.integrations.poisson_batches import model_columns
from dptext.integrations.trainer_losses import base_model

logger = logging.getLogger(__name__)

DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU")  # accelerate's plain processes: DDP is what we replace


def without_trainer_clipping(args: Any) -> Any:
    """``args`` with ``max_grad_norm`` = 0: the engine clips each example to its own C."""
    if args.max_grad_norm and args.max_grad_norm > 0:
        logger.warning("DPTrainer turns off TrainingArguments.max_grad_norm=%s: the privacy engine clips every "
                       "example's gradient to PrivacyArguments.max_grad_norm instead.", args.max_grad_norm)
        args.max_grad_norm = 0.0  # the Trainer reads it from its own args, which is this object
    return args


IN_BACKWARD_OPTIMIZERS = ("lomo", "adalomo")  # with the *_layerwise ones: an update per parameter during backward


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
    optim = str(getattr(args.optim, "value", args.optim))
    if optim in IN_BACKWARD_OPTIMIZERS or optim.endswith("_layerwise"):
        raise UserError(f"optim='{optim}' updates each parameter inside the backward pass from its raw gradient, "
                        "before the engine clips and noises it; choose one that steps once per batch, such as "
                        "adamw_torch or galore_adamw (not a _layerwise one).")
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


def check_privacy_arguments(privacy: Any) -> None:
    """ε, σ and C as the recipe bounds them: a NaN ε compared False everywhere (the budget silently off), C = inf
    clipped nothing (noise σ·C = inf), a σ below the accountants' floor gave ε in the thousands."""
    if privacy.target_epsilon is None and privacy.noise_multiplier is None:
        raise UserError("Give PrivacyArguments a target_epsilon (σ is calibrated to it) or a noise_multiplier.")
    if privacy.target_epsilon is not None:
        check_epsilon(privacy.target_epsilon)
    if not (isinstance(privacy.max_grad_norm, (int, float)) and math.isfinite(privacy.max_grad_norm)
            and privacy.max_grad_norm > 0):
        raise UserError(f"max_grad_norm (C) must be a positive finite number, got {privacy.max_grad_norm!r}.")
    if privacy.noise_multiplier is not None and 0 < privacy.noise_multiplier < MIN_SIGMA:
        raise UserError(f"noise_multiplier={privacy.noise_multiplier:g} is below {MIN_SIGMA}, where ε is in the "
                        "thousands or beyond (no meaningful privacy); raise it (or use 0 only to test clipping).")


SCALARS = (int, float, bool, str, bytes, type(None))


def _plain(value: Any) -> Any:
    """``value`` as plain Python at any depth (tensors, numpy arrays and scalars as lists and numbers): numpy and
    torch abbreviate an array of over 1000 values in its repr, and a copy given as numpy must equal one as lists."""
    if hasattr(value, "tolist") and not isinstance(value, SCALARS):
        value = value.tolist()
    if isinstance(value, dict):
        return sorted(((str(key), _plain(item)) for key, item in value.items()), key=lambda pair: pair[0])
    if isinstance(value, (list, tuple)) and not all(isinstance(item, SCALARS) for item in value):
        return [_plain(item) for item in value]
    return list(value) if isinstance(value, tuple) else value


def row_digest(row: Any, columns: Any = None) -> bytes:
    """A digest of one dataset row's content (as values, not as objects): of its ``columns`` (those the model is
    fed) when it has any of them, else of the whole row."""
    if isinstance(row, dict) and columns is not None:
        row = {key: value for key, value in row.items() if key in columns} or row
    return hashlib.blake2b(repr(_plain(row if isinstance(row, dict) else {"": row})).encode(),
                           digest_size=16).digest()


def dataset_rows(dataset: Any):
    """An iterator over a sized, indexable dataset's rows (a ``datasets.Dataset`` read in batches as plain Python,
    whatever its format), or None for one that is not (an iterable dataset: nothing to compare)."""
    if not hasattr(dataset, "__len__") or isinstance(dataset, torch.utils.data.IterableDataset) \
            or not hasattr(dataset, "__getitem__"):
        return None
    if hasattr(dataset, "with_format") and hasattr(dataset, "iter") and hasattr(dataset, "column_names"):
        return (dict(zip(batch, values)) for batch in dataset.with_format(None).iter(batch_size=1000)
                for values in zip(*batch.values()))
    return (dataset[i] for i in range(len(dataset)))


def row_digests(dataset: Any, columns: Any = None) -> set[bytes]:
    """The digests of every row of a sized dataset (an empty set for one without a length or an index)."""
    rows = dataset_rows(dataset)
    return set() if rows is None else {row_digest(row, columns) for row in rows}


def refuse_evaluation_on_training_data(eval_dataset: Any, train_dataset: Any, training_rows=None,
                                       columns: Any = None) -> None:
    """Metrics on the training records are exact statistics of private data, not post-processing of the DP model,
    and load_best_model_at_end, reduce_lr_on_plateau or early stopping would steer the weights by them (red team,
    session 29). The same dataset object, or one more than half of whose rows are training rows by content (a copy;
    a few rows that happen to be equal are records of another set): ``training_rows``, the training rows' digests
    (``row_digests`` of ``columns``, the columns the model is fed, computed once by the caller)."""
    datasets = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
    for data in datasets:
        if train_dataset is None or data is None:
            continue
        rows = dataset_rows(data) if data is not train_dataset and training_rows else None
        copied = rows is not None and len(data) > 0 and \
            sum(row_digest(row, columns) in training_rows for row in rows) * 2 > len(data)
        if data is train_dataset or copied:
            raise UserError(f"eval_dataset is the training data{' (a copy of its rows)' if copied else ''}: its "
                            "metrics are exact statistics of the private records that ε does not cover (and "
                            "anything steered by them, such as load_best_model_at_end, would not be covered "
                            "either); evaluate on held-out data.")


def refuse_evaluation_of(trainer: Any, eval_dataset: Any) -> None:
    """``DPTrainer.evaluate``'s check: the dataset it evaluates (a name is a key of ``trainer.eval_dataset``, as
    for ``Trainer.evaluate``), against the training rows' digests over the columns the model is fed (the
    Trainer drops the others, ``remove_unused_columns``), computed once and kept on the trainer."""
    own = trainer.eval_dataset
    chosen = own if eval_dataset is None else eval_dataset
    if isinstance(chosen, str) and isinstance(own, dict):
        chosen = own.get(chosen)
    columns = model_columns(base_model(trainer.model), trainer.args.remove_unused_columns)
    if getattr(trainer, "_training_rows", None) is None:
        trainer._training_rows = row_digests(trainer.train_dataset, columns) \
            if trainer.train_dataset is not None else set()
    refuse_evaluation_on_training_data(chosen, trainer.train_dataset, trainer._training_rows, columns)


def refuse_left_padding(batch: dict[str, Any]) -> None:
    """A micro-batch padded on the left: most models number positions from the batch's left edge, so an example's
    loss depended on the longest example it was batched with and one record moved the others' clipped gradients
    (GPT-2, red team, session 29). Padding before a token is refused, whatever position_ids say."""
    mask = batch.get("attention_mask")
    if torch.is_tensor(mask) and mask.ndim == 2 and bool(((mask[:, :-1] == 0) & (mask[:, 1:] != 0)).any()):
        raise UserError("The data collator pads on the left (attention_mask has padding before tokens), so an "
                        "example's positions, and its gradient, would depend on the other examples of its "
                        "micro-batch; pad on the right (tokenizer.padding_side = 'right').")


def refuse_hub_upload(args: Any) -> None:
    """push_to_hub uploads output_dir whole, the files release.json lists as not covered included."""
    if getattr(args, "push_to_hub", False):
        raise UserError("push_to_hub would upload output_dir whole, including files release.json lists as not "
                        "covered by ε (trainer_state.json's per-step losses, train_results.json); set "
                        "push_to_hub=False and upload the files release.json lists as covered or public.")
