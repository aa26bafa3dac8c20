"""``DPTrainer``: a Hugging Face ``Trainer`` whose training steps are dptext's DP-SGD steps (SPEC §1–3).

An existing Trainer script becomes differentially private by swapping the class and saying the privacy settings::

    from dptext.integrations import DPTrainer, PrivacyArguments
    trainer = DPTrainer(model=model, args=training_args, train_dataset=train, data_collator=collator,
                        privacy=PrivacyArguments(target_epsilon=8, max_grad_norm=1.0, expected_batch_size=64))
    trainer.train()

What changes inside the Trainer (docs/integrations.md has the whole story):
* batches: the engine's Poisson sampler (rate q = B/n) replaces the Trainer's shuffled batches; each logical batch
  is split into micro-batches of ``per_device_train_batch_size`` (``poisson_batches``);
* the loss: one loss per example (``trainer_losses``), never the model's batch mean;
* the step: ``PrivacyEngine`` clips every example, adds N(0, σ²C²) once and divides by B; the Trainer's optimizer
  (any torch optimizer it builds from ``args.optim``) steps on that, and its scheduler runs as usual;
* before the first private batch the start-up probe checks the engine against per-example autograd on synthetic
  inputs; ε (the engine's accountant at δ) is added to every log, and training stops before a step would take ε
  over ``target_epsilon``;
* several processes (torchrun, accelerate launch): dptext's data-parallel step — each rank Poisson-samples its
  shard, clipped sums are all-reduced, rank 0 adds the noise once, no DDP. Refusals: ``trainer_checks``.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from dptext.accounting import calibrate_noise_multiplier, compute_epsilon, StepRun
from dptext.accounting.calibrate import check_training_accountant
from dptext.accounting.events import check_delta, check_large_delta
from dptext.errors import UserError
from dptext.finetune.distributed import current as current_process_group
from dptext.integrations.poisson_batches import LogicalBatch, PoissonBatches, model_input_collator
from dptext.integrations.trainer_checks import (check_privacy_arguments, refuse_evaluation_of,
                                                refuse_evaluation_on_training_data, refuse_gradient_reducing_wrapper,
                                                refuse_hub_upload, refuse_left_padding, refuse_unsupported_arguments,
                                                refuse_unsupported_launch, without_trainer_clipping)
from dptext.integrations.trainer_losses import BatchMaker, LossFn, base_model, loss_and_probe_batch
from dptext.integrations.trainer_release import ReleaseListing, trainer_flags, write_privacy_report
from dptext.privacy import PrivacyEngine

logger = logging.getLogger(__name__)


@dataclass
class PrivacyArguments:
    """The privacy settings of a DPTrainer run (those of ``TrainingArguments`` change nothing about privacy).

    Give ``target_epsilon`` (σ is calibrated so the planned steps spend it) or ``noise_multiplier`` σ (then
    ``target_epsilon``, if given too, is a budget the run stops before exceeding)."""

    max_grad_norm: float  # C: every example's gradient is clipped to this L2 norm
    expected_batch_size: int  # B, the expected logical batch over all processes: q = B / len(train_dataset)
    target_epsilon: float | None = None
    noise_multiplier: float | None = None
    delta: float | None = None  # None: 1/(2n), Li et al.'s default
    accountant: str = "rdp"  # rdp, prv or pld: calibrates and reports (a guaranteed bound, never gdp)
    clipping_mode: str = "bookkeeping"  # or ghost (one process only), per_sample
    clipping_layout: str = "all_layer"  # or per_layer
    loss_reduction: str = "sum"  # causal LM: sum or mean over each example's own labelled tokens
    seed: int | None = None  # None: a secret random root; an int makes sampling and noise reproducible
    allow_large_delta: bool = False  # δ ≥ 0.1 (any ε is then meaningless) is refused unless this is set


class EngineStep(torch.optim.Optimizer):
    """What the Trainer sees as its optimizer: ``step()`` is the engine's noisy step, which then steps the
    optimizer the Trainer built. ``param_groups`` and the state are that optimizer's, so the Trainer's learning-rate
    scheduler and checkpoints work on it. (Like accelerate's optimizer wrapper, it does not call
    ``Optimizer.__init__``: it owns no parameters of its own.)"""

    def __init__(self, engine: PrivacyEngine, check_budget):
        self.engine = engine
        self.optimizer = engine.optimizer
        self.defaults = self.optimizer.defaults
        self.check_budget = check_budget

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)  # the engine's clipped sums live apart, in the engine

    def step(self, closure=None):
        self.check_budget()
        self.engine.step()


class PrivacyCallback(TrainerCallback):
    """Stops training before the step that would take ε over the budget; puts the privacy report (what was spent
    up to that step) into every checkpoint folder the Trainer writes."""

    def __init__(self, trainer: "DPTrainer"):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer.engine is not None and self.trainer.next_step_exceeds_budget():
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        if args.should_save and self.trainer.engine is not None:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            self.trainer.save_privacy_report(folder)
            self.trainer.refresh_release()  # the checkpoint's trainer_state.json (flos, runtime) is listed too
        return control


class DPTrainer(ReleaseListing, Trainer):
    """A ``transformers.Trainer`` that trains with DP-SGD (DP-Adam, ...): see the module docstring.

    ``per_example_loss(model, batch) -> Tensor (B,)`` is needed for heads other than causal LM and single-label
    sequence classification; ``probe_batch(examples, positions, generator) -> dict`` gives the start-up probe
    synthetic batches in that loss's format (random, never a record)."""

    def __init__(self, *args: Any, privacy: PrivacyArguments, per_example_loss: LossFn | None = None,
                 probe_batch: BatchMaker | None = None, **kwargs: Any):
        if kwargs.get("compute_loss_func") is not None:
            raise UserError("DPTrainer needs one loss per example, not compute_loss_func's batch loss; pass "
                            "per_example_loss=fn(model, batch) returning a (B,) tensor instead.")
        refuse_hub_upload(kwargs.get("args", args[1] if len(args) > 1 else None))  # before the Trainer's hub set-up
        super().__init__(*args, **kwargs)
        refuse_unsupported_arguments(self.args)
        refuse_unsupported_launch(self.accelerator, {"tensor": self.get_tp_size(), "context": self.get_cp_size(),
                                                     "sequence": self.get_sp_size()})
        self.args = without_trainer_clipping(self.args)
        check_training_accountant(privacy.accountant)
        check_privacy_arguments(privacy)
        refuse_evaluation_on_training_data(self.eval_dataset, self.train_dataset)
        if self.train_dataset is None or not hasattr(self.train_dataset, "__len__"):
            raise UserError("DPTrainer needs a train_dataset with a length (Poisson sampling draws from all n "
                            "examples); materialise an iterable dataset first.")
        self.privacy = privacy
        self.dataset_size = len(self.train_dataset)
        if not 0 < privacy.expected_batch_size <= self.dataset_size:
            raise UserError(f"expected_batch_size must be between 1 and the {self.dataset_size} training examples.")
        self.sample_rate = privacy.expected_batch_size / self.dataset_size
        self.delta = check_delta(privacy.delta if privacy.delta is not None else 1 / (2 * self.dataset_size))
        check_large_delta(self.delta, "given" if privacy.delta is not None else "1/(2n), the default",
                          privacy.allow_large_delta, "set PrivacyArguments.allow_large_delta=True")
        self.loss_fn, self.probe_batch = loss_and_probe_batch(self.model, privacy.loss_reduction, per_example_loss,
                                                              probe_batch)
        self.engine: PrivacyEngine | None = None
        self.planned_steps: int | None = None
        self.process_group = current_process_group(self.args.device.type)
        if self.process_group.active and privacy.clipping_mode == "ghost":
            raise UserError("Ghost clipping needs autograd's parameter gradients, which accelerate would reduce "
                            "with DDP outside the engine; use clipping_mode='bookkeeping' with several processes.")
        if self.process_group.active:
            # The Trainer's flag for "the model owns its gradient reduction": accelerate then prepares the model
            # without wrapping it in DDP (whose all-reduce of raw gradients would bypass the engine's); the
            # engine all-reduces the clipped sums and rank 0 adds the noise (dptext.privacy.sharding.distributed).
            self.is_distributed_loading_by_transformers = True
        self.add_callback(PrivacyCallback(self))

    # ------------------------------------------------------------------ the run

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any):
        if resume_from_checkpoint:
            raise UserError("DPTrainer cannot resume from a Trainer checkpoint yet (the privacy account and the "
                            "sampler's state are not in it); start a new run.")
        if self.engine is not None:
            raise UserError("This DPTrainer has trained once; a second train() would start a second privacy "
                            "account on the same data, so build a new DPTrainer (and add up the ε of both runs).")
        output = super().train(None, *args, **kwargs)
        if self.args.should_save:
            self.save_privacy_report(self.args.output_dir)
            self.refresh_release()
        return output

    def evaluate(self, eval_dataset: Any = None, *args: Any, **kwargs: Any):
        refuse_evaluation_of(self, eval_dataset)  # by content too: the training rows' digests are taken once
        return super().evaluate(eval_dataset, *args, **kwargs)

    def predict(self, test_dataset: Any, *args: Any, **kwargs: Any):
        refuse_evaluation_of(self, test_dataset)  # predictions (and metrics) on training rows are as exact
        return super().predict(test_dataset, *args, **kwargs)

    def set_initial_training_values(self, args, dataloader):
        values = super().set_initial_training_values(args, dataloader)
        self.planned_steps = values[-1]  # max_steps: the steps σ is calibrated for and the sampler draws
        return values

    def get_train_dataloader(self) -> PoissonBatches:
        # a PEFT wrapper's forward takes **kwargs: the columns are those its base model accepts, as the Trainer does
        collate = model_input_collator(self.data_collator, base_model(self.model), self.args.remove_unused_columns)
        steps_per_epoch = max(1, round(1 / self.sample_rate))
        return PoissonBatches(self.train_dataset, collate, self.args.per_device_train_batch_size, steps_per_epoch,
                              lambda: self.engine.sampler(self.planned_steps))

    def create_optimizer(self, model: Any = None):
        """The Trainer's optimizer (from ``args.optim``), privatized: the engine is built and probed here, before
        the first private batch (the Trainer calls this once its step count is known)."""
        optimizer = super().create_optimizer(model)
        if self.engine is None:
            self.engine = self._build_engine(optimizer)
            self.optimizer = EngineStep(self.engine, self.check_budget)
        return self.optimizer

    def _build_engine(self, optimizer: torch.optim.Optimizer) -> PrivacyEngine:
        if self.planned_steps is None:
            raise UserError("DPTrainer builds its privacy engine when train() starts; call trainer.train() rather "
                            "than create_optimizer() directly.")
        p = self.privacy
        sigma = p.noise_multiplier
        if sigma is None:
            sigma = calibrate_noise_multiplier(p.target_epsilon, self.delta, self.sample_rate, self.planned_steps,
                                               method=p.accountant).noise_multiplier
        if sigma == 0:
            logger.warning("noise_multiplier=0: the steps are clipped but not noised, so this run has no privacy "
                           "guarantee (ε = inf); use it only to test the clipping.")
        if p.target_epsilon is not None and self.epsilon_after(1, sigma) > p.target_epsilon:
            raise UserError(f"One step at σ = {sigma:.3g} already spends more than ε = {p.target_epsilon}; raise "
                            "noise_multiplier or target_epsilon.")
        self.process_group.broadcast_parameters(self.model)  # every rank starts from rank 0's weights
        engine = PrivacyEngine(self.model, optimizer, noise_multiplier=sigma, max_grad_norm=p.max_grad_norm,
                               sample_rate=self.sample_rate, dataset_size=self.dataset_size,
                               clipping_mode=p.clipping_mode, clipping_layout=p.clipping_layout, seed=p.seed,
                               distributed=self.process_group)
        engine.verify(make_batch=self.probe_batch, loss_fn=self.loss_fn)  # synthetic inputs: no privacy cost
        return engine

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """One logical batch: every micro-batch's per-example losses go into the engine (clipped sums); the noisy
        step follows when the Trainer calls the optimizer. Returns the batch's mean loss (for the Trainer's log)."""
        if not isinstance(inputs, LogicalBatch):
            raise UserError("DPTrainer trains on its own Poisson batches; do not override get_train_dataloader.")
        refuse_gradient_reducing_wrapper(model)
        model.train()
        total = torch.zeros((), dtype=torch.float64)
        for chunk in inputs.chunks:
            refuse_left_padding(chunk)
            batch = {k: v.to(self.args.device) if torch.is_tensor(v) else v for k, v in chunk.items()}
            losses = self.loss_fn(model, batch)
            self.engine.accumulate(losses)
            total += losses.detach().double().sum().cpu()
        return (total / max(inputs.size, 1)).float().to(self.args.device)

    def floating_point_ops(self, inputs: Any) -> int:
        chunks = inputs.chunks if isinstance(inputs, LogicalBatch) else [inputs]
        return sum(super(DPTrainer, self).floating_point_ops(chunk) for chunk in chunks)

    # ------------------------------------------------------------------ the privacy account

    def epsilon_after(self, steps: int, sigma: float | None = None) -> float:
        sigma = self.engine.noise_multiplier if sigma is None else sigma
        if sigma == 0:  # no noise, no guarantee (allowed for tests: the clipped sums alone)
            return math.inf
        result = compute_epsilon(self.privacy.accountant, [StepRun(self.sample_rate, sigma, steps)], self.delta)
        return result.guaranteed

    def epsilon(self) -> float:
        """ε spent so far at δ, by the accountant that calibrated the run."""
        if self.engine is None or self.engine.steps == 0:
            return 0.0
        return self.epsilon_after(self.engine.steps)

    def next_step_exceeds_budget(self) -> bool:
        target = self.privacy.target_epsilon
        return target is not None and self.epsilon_after(self.engine.steps + 1) > target

    def check_budget(self) -> None:
        if self.next_step_exceeds_budget():  # the callback stops first; this holds if something bypasses it
            raise UserError(f"The next step would spend more than ε = {self.privacy.target_epsilon}; training "
                            "stops here.")

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.engine is not None:
            logs["epsilon"] = self.epsilon()
            # the Trainer measures .grad, which the engine never leaves holding a private gradient: drop the 0
            logs.pop("grad_norm", None)
        super().log(logs, *args, **kwargs)

    def privacy_report(self) -> dict[str, Any]:
        """What was spent and how: the accountant's inputs, ε at δ, the mechanism (for the run's records)."""
        return {"epsilon": self.epsilon(), "delta": self.delta, "accountant": self.privacy.accountant,
                "planned_steps": self.planned_steps, "dataset_size": self.dataset_size,
                **self.engine.accounting(), "mechanism": self.engine.mechanism(),
                "privacy_arguments": {k: v for k, v in asdict(self.privacy).items() if k != "seed"},
                "written_by": "dptext.DPTrainer", "flags": trainer_flags(self.privacy, self.engine.noise_multiplier)}

    def save_privacy_report(self, folder: str) -> None:
        write_privacy_report(folder, self.privacy_report())
