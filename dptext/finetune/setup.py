"""Everything a fine-tuning run needs, built from its recipe: data, task, model, optimizer, privacy.

``build_training(recipe)`` returns a ``Training`` bundle; the loop (``dptext.finetune.loop``)
only iterates it. Privacy numbers come from one place: ``plan_for_recipe`` gives q, steps and
δ, the recipe's accountant calibrates σ, and the same q and σ drive the engine, the sampler and
the ledger, so the ε reported is the ε of the run that happened.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dptext.accounting import PrivacyLedger, calibrate_noise_multiplier, plan_for_recipe
from dptext.accounting.calibrate import check_training_accountant
from dptext.adaptation import apply_adaptation, trainable_summary
from dptext.data import load_records
from dptext.data.audit_split import audit_requested, split_for_audit
from dptext.errors import UserError
from dptext.finetune.banded_mf import build_banded_mf
from dptext.finetune.distributed import current
from dptext.finetune.edp import build_edp
from dptext.finetune.meta_load import load_sharded
from dptext.finetune.seeds import privacy_seed, seed_everything
from dptext.finetune.sharding import check_sharding, mark_verified, proven_before_sharding, prove_then_shard
from dptext.finetune.task_probe import verify_with_task
from dptext.data.users import user_groups
from dptext.finetune.user_level import check_user_level
from dptext.finetune.validate import check_records, copies_in_training
from dptext.models import load_tokenizer
from dptext.privacy import PrivacyEngine
from dptext.privacy.sampling.sampler import make_sampler
from dptext.privacy.sharding.sharded import is_sharded
from dptext.tasks import build_task

CPU_PHYSICAL_BATCH = 16  # CPU RAM is rarely the limit at these model sizes; an OOM there kills the process
GPU_PROBE_START = 256
PROBE_WORD = "the"  # filler of the memory probe's synthetic examples: a public word every tokenizer knows


@dataclass
class Training:
    recipe: Any
    device: Any
    task: Any
    model: Any
    tokenizer: Any
    optimizer: Any
    examples: list
    eval_records: list
    final_records: list
    plan: Any
    noise_multiplier: float | None
    engine: Any = None  # None for the non-private baseline
    ledger: Any = None
    sampler: Any = None
    physical_batch_size: int = CPU_PHYSICAL_BATCH
    autocast_dtype: Any = None
    info: dict = field(default_factory=dict)
    audit: Any = None  # dptext.data.audit_split.AuditSplit when the recipe's audit section asks for one
    dist: Any = None  # dptext.finetune.distributed.ProcessGroup (world size 1 unless launched by torchrun)
    mf_strategy: Any = None  # privacy.mechanism=banded_mf or blt: the strategy's parameters (mf_strategy.json)
    selection: Any = None  # dptext.finetune.selection.Selection when the recipe selects on validation
    users: Any = None  # privacy.unit=user: the example indices of each user (the privacy units), else None
    split_copies: int = 0  # evaluation records with a word-for-word copy in the training split (not covered)
    start_flags: list = field(default_factory=list)  # what the start model carries (finetune.start_model)

    @property
    def private(self) -> bool:
        return self.engine is not None


def pick_device(name: str):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"train.device={name} but no CUDA GPU is visible; use train.device=cpu or auto.")
    return torch.device(name)


def autocast_dtype(precision: str, device) -> Any:
    if precision == "fp32" or (precision == "auto" and device.type != "cuda"):
        return None
    if device.type != "cuda":
        raise UserError(f"train.precision={precision} needs a GPU; use fp32 (or auto) on CPU.")
    return torch.float16 if precision == "fp16" else torch.bfloat16


def whole_model(recipe: Any, task: Any, device: torch.device, dist: Any) -> Any:
    """The task's model, whole on this rank, with rank 0's weights (they are seeded alike; this makes it certain)."""
    model = task.load_model()
    if recipe.model.untie_embeddings:
        untie_output_embedding(model)
    model = apply_adaptation(model, recipe).to(device)
    model.train()
    dist.broadcast_parameters(model)
    return model


def untie_output_embedding(model: Any) -> None:
    """Give the LM head its own copy of the tied input embedding (only on explicit request)."""
    head = model.get_output_embeddings()
    if head is None:
        raise UserError("model.untie_embeddings=true but this model has no output embedding to untie.")
    head.weight = torch.nn.Parameter(head.weight.detach().clone())
    model.config.tie_word_embeddings = False


def make_optimizer(recipe: Any, params: list):
    cfg = recipe.train
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    return torch.optim.Adam(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)


def load_splits(recipe: Any) -> tuple[list, list, list]:
    train = load_records(recipe.data, "train")
    if not train:
        raise UserError("The training split is empty; check data.path and data.max_train_examples.")
    validation = load_records(recipe.data, "validation")
    final = validation if recipe.eval.split == "validation" else load_records(recipe.data, "test")
    # a run would print ε beside no metric at all (a 1-record file: δ = 0.5 and "ε ≤ 8", nothing else);
    # data.max_eval_examples = 0 asks for no evaluation on purpose (dptext mia's reference models)
    if not final and recipe.data.max_eval_examples != 0:
        split, fraction = recipe.eval.split, recipe.data.validation_fraction
        raise UserError(f"The {split} split (eval.split) has no record, so the run could report no metric; give the "
                        f"data more records (a source without its own {split} split holds out round(n × "
                        f"data.validation_fraction) = round(n × {fraction:g}) of them for it) or raise "
                        "data.validation_fraction.")
    check_records(recipe, {"train": train, "validation": validation, recipe.eval.split: final})
    return train, validation, final


def noise_for(recipe: Any, plan: Any) -> float:
    """σ: the recipe's pinned noise multiplier, or calibrated to the target ε by the recipe's accountant."""
    privacy = recipe.privacy
    if privacy.noise_multiplier is not None:
        return privacy.noise_multiplier
    if privacy.target_epsilon is None:
        raise UserError("Set privacy.target_epsilon (or privacy.noise_multiplier), or privacy.enabled=false "
                        "for a non-private baseline.")
    return calibrate_noise_multiplier(privacy.target_epsilon, plan.delta, plan.sample_rate, plan.steps,
                                      method=privacy.accountant, steps_per_epoch=plan.steps_per_epoch
                                      ).noise_multiplier


def build_training(recipe: Any, probe_now: bool = True) -> Training:
    """``probe_now=False`` leaves the start-up probe (``privacy.verify``) to a caller that replaces the task first
    (distillation's teacher loss), so it runs once, on the loss that trains."""
    check_user_level(recipe)  # also here: distill and tests build without validate_run
    seed_everything(recipe.train.seed)
    device = pick_device(recipe.train.device)
    dist = current(recipe.train.device)
    dist.sharded = recipe.train.sharding == "fsdp"
    if dist.sharded:
        check_sharding(recipe, dist.world_size, probe_now)
    if dist.active and device.type == "cuda":  # one process per GPU
        device = torch.device("cuda", dist.local_rank)
    train, validation, final = load_splits(recipe)
    audit = None
    if audit_requested(recipe.audit):  # hold out non-members / public records, add canaries: before anything sees n
        audit = split_for_audit(recipe, train)
        train = audit.training_records(recipe.task.type, recipe.task.control_codes)
    tokenizer = load_tokenizer(recipe.model.name)
    task = build_task(recipe, tokenizer, train)
    model = load_sharded(recipe, task, device, dist) if dist.sharded else None  # no rank holds all of it
    if model is None:
        model = whole_model(recipe, task, device, dist)
    seed_everything(recipe.train.seed, "dropout", dist.rank)  # dropout: a stream apart from initialisation
    # the optimizer and the engine are built on the sharded parameters (the meta path sharded them already)
    if dist.sharded and not any(is_sharded(param) for param in model.parameters()):
        model = prove_then_shard(recipe, task, model, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(recipe, params)
    privacy = recipe.privacy
    users = user_groups(train) if privacy.enabled and privacy.unit == "user" else None
    units = len(train) if users is None else len(users)  # q, steps and δ count the privacy units
    plan = plan_for_recipe(recipe, units, "" if users is None else "users")
    training = Training(recipe=recipe, device=device, task=task, model=model, tokenizer=tokenizer,
                        optimizer=optimizer, examples=task.encode(train), eval_records=validation,
                        final_records=final, plan=plan, noise_multiplier=None,
                        autocast_dtype=autocast_dtype(recipe.train.precision, device),
                        info={**trainable_summary(model), **({"dataset_size": len(train)} if users is None else {})},
                        audit=audit, dist=dist, users=users, split_copies=copies_in_training(train, final))
    if privacy.method != "edp_sgd" and privacy.noise_decay != "none":
        raise UserError("privacy.noise_decay applies to privacy.method=edp_sgd; set it to none for dp_sgd.")
    if privacy.enabled:
        check_training_accountant(privacy.accountant)
        privacy_seed(privacy, recipe.train.seed)  # refuses contradictory randomness settings before any work
    if privacy.enabled and privacy.mechanism == "dp_sgd" and privacy.sampling == "cyclic":
        raise UserError("privacy.sampling=cyclic is accounted only with privacy.mechanism=banded_mf or blt (DP-SGD's "
                        "accountant assumes Poisson sampling); use sampling=poisson, or mechanism=banded_mf or blt.")
    if privacy.enabled and privacy.mechanism in ("banded_mf", "blt"):
        build_banded_mf(training, dist, probe_now)
    elif privacy.enabled and privacy.method == "edp_sgd":
        build_edp(training, dist, probe_now)
    elif privacy.enabled:
        training.noise_multiplier = noise_for(recipe, plan)
        training.ledger = PrivacyLedger(delta=plan.delta, dataset_size=units, accountant=privacy.accountant,
                                        delta_source=plan.delta_source)
        training.engine = PrivacyEngine(
            model, optimizer, noise_multiplier=training.noise_multiplier, max_grad_norm=privacy.max_grad_norm,
            sample_rate=plan.sample_rate, dataset_size=units, clipping_mode=privacy.clipping_mode,
            clipping_layout=privacy.clipping_layout, sampling=privacy.sampling,
            seed=privacy_seed(privacy, recipe.train.seed), secure_rng=privacy.secure_rng,
            ledger=training.ledger.record_step, distributed=dist, verify=privacy.verify,
            max_stored_bytes=privacy.max_stored_bytes,  # long sequences: the hybrid (privacy/clipping/hybrid.py)
            sequence_length=recipe.data.max_length if privacy.max_stored_bytes is not None else None)
        if probe_now and dist.sharded and proven_before_sharding(recipe, device, model):  # proven before fully_shard
            mark_verified(training.engine, training.autocast_dtype)
        elif privacy.verify and probe_now:
            verify_with_task(training.engine, task, model, training.autocast_dtype)
        training.sampler = (training.engine.sampler(plan.steps) if users is None else
                            training.engine.user_sampler(users, privacy.max_examples_per_user, plan.steps))
        training.ledger.mechanism = training.engine.mechanism()  # after the sampler: it says which unit ε is about
    else:  # no clipping or noise: the non-private baseline of the same recipe (its batches need no secret)
        sampling = privacy.sampling if not dist.active else "poisson"
        training.sampler = make_sampler(len(train), plan.sample_rate, plan.steps, recipe.train.seed, sampling, dist)
    training.physical_batch_size = recipe.train.physical_batch_size or choose_physical_batch_size(training, train)
    if users is not None and training.physical_batch_size < privacy.max_examples_per_user:  # GPU memory probe
        raise UserError(f"Only {training.physical_batch_size} examples fit in one micro-batch on this device but a "
                        f"user's {privacy.max_examples_per_user} must be clipped together; lower "
                        "privacy.max_examples_per_user or data.max_length.")
    return training


def probe_records(template: dict[str, Any], count: int, max_length: int) -> list[dict[str, Any]]:
    """``count`` synthetic records with the training records' fields (the schema, not their values) filled with
    a public word up to the maximum length: strings of ``max_length`` words, lists of ``max_length`` items,
    numbers 0. The memory probe runs on these, never on private examples, so the size it finds is public."""
    def fill(value: Any) -> Any:
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, float)):
            return 0
        if isinstance(value, list):
            return [fill(value[0]) if value else PROBE_WORD] * max_length
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        return " ".join([PROBE_WORD] * max_length)

    record = {key: fill(value) for key, value in template.items()}
    return [record] * count


def choose_physical_batch_size(training: Training, train_records: list) -> int:
    """The largest power-of-two micro-batch (≤ expected batch) that survives a step on maximum-length synthetic
    examples (GPU; ``probe_records``: no private example enters the probe, so the size is a public choice).

    On CPU a fixed size is used: host memory rarely limits these models, and running out of it kills the
    process instead of raising an error we could recover from. The micro-batch size does not change privacy.
    """
    # user-level: rows per step ≤ k per sampled user (an upper bound of public numbers), and a user's k in one call
    per_user = training.recipe.privacy.max_examples_per_user if training.users is not None else 1
    expected = max(per_user, int(round(training.plan.sample_rate * training.plan.dataset_size * per_user)))
    if training.device.type != "cuda":
        return min(max(CPU_PHYSICAL_BATCH, per_user), expected)
    size = min(max(GPU_PROBE_START, per_user), expected)
    longest = training.task.encode(probe_records(train_records[0], size, training.recipe.data.max_length))
    while size > 1:
        try:
            batch = {k: v.to(training.device) for k, v in training.task.collate(longest[:size]).items()}
            with torch.autocast("cuda", dtype=training.autocast_dtype, enabled=training.autocast_dtype is not None):
                loss = training.task.per_example_loss(training.model, batch)
            if training.engine is not None:  # user-level: synthetic users of k rows, grouped as the loop groups
                units = None if training.users is None else torch.arange(size) // per_user
                training.engine.accumulate(loss, units=units)
                training.engine.zero_grad()
            else:
                loss.sum().backward()
                training.optimizer.zero_grad(set_to_none=True)
            return size
        except torch.cuda.OutOfMemoryError:
            if training.engine is not None:
                training.engine.zero_grad()
            torch.cuda.empty_cache()
            size //= 2
    return 1
