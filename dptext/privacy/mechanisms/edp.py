"""eDP-SGD (Dupuy et al. 2021, Algorithm 1) with the privacy fixes of SPEC §4.

The clipping unit is a *micro-batch*, not an example: its mean gradient Δ_m is computed by ordinary autograd
(one backward pass, no per-example work — the method's whole speed-up), scaled per parameter tensor by 1/α_l,
clipped as one vector to norm C, and summed. Once per step Gaussian noise N(0, (C·z_t)²) is added to that sum
*in the scaled space*, then each parameter is multiplied back by α_l (so layer l's noise has std α_l·C·z_t) and
divided by the constant number of micro-batch slots M.

Micro-batch membership depends on each example alone (SPEC §4): with N processes and K micro-batches per
process (``micro_batches_per_device``) there are M = N·K slots, and example i's slot is a keyed hash of its
stable record id (``record_ids``, e.g. a digest of its tokens) under a secret key from the run's random root
(child "edp_slots"); its rank is slot mod N. Without record ids (library use in one process) each sampled
example gets a fresh independent slot each step from the "edp_slots" stream. Each step Poisson-samples every
example with rate q; slot m's micro-batch is its sampled examples. Adding or removing one example therefore
changes only its own slot's micro-batch, whose clipped gradient moves by at most 2C (both versions have norm
≤ C). A slot taken from the position ("i mod M", the paper's rule until issue 21) breaks this: removing one
record shifts every later record to another slot and the sum moves by up to (√2−1)·C·√M. The mechanism depends
on public settings only (M, the recipe), never on n (issue 43): sensitivity 2C and the keyed hash (or per-step
draw) whatever n is; M > n used to switch to sensitivity C with slot = index, so datasets of n = M−1 and n = M ran
different mechanisms, 4.13·C apart where the ledger assumed C. For sensitivity C, use dp_sgd.

Accounting: the sampled Gaussian mechanism with rate q and noise multiplier σ_t = z_t / 2 (noise std C·z_t over
sensitivity 2C). The noise decays by epoch: z_t = z_0·d(t), t = ⌊step / steps_per_epoch⌋, steps_per_epoch =
round(1/q), d = 1, 1/(1+τt) or e^{−τt} (``dptext.accounting.schedule``, the same code the accountant composes).
The ledger records each step's σ_t, so its ε is that of ``dptext account --sigma σ_0 --schedule ...``.

Scaling α (one per parameter tensor): uniform (α = 1), measured on a public batch (no privacy cost), or
measured on the first private examples ("first_step", as the paper does) — a data-dependent choice the (ε, δ)
does not cover, so it is labelled as leaking. Measured α are the per-tensor gradient norms normalised to
root-mean-square 1, floored at ``ALPHA_FLOOR``.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from dptext.accounting.schedule import CONSTANT, NoiseSchedule
from dptext.errors import UserError
from dptext.accounting.pld import MIN_SIGMA
from dptext.privacy.settings import check_noise, fixed_setting
from dptext.privacy.proof.step_checks import FOREIGN_GRADIENT, grads_as_left, grads_now, refuse_foreign_step
from dptext.privacy.clipping.sums import STABILITY
from dptext.privacy.proof.edp_probe import probe_edp
from dptext.privacy.engine import PrivacyEngine
from dptext.privacy.noise.optimizer import DPOptimizer, NoiseSource
from dptext.privacy.clipping.call_checks import refuse_mode_around
from dptext.privacy.clipping.plan import _check_optimizer
from dptext.privacy.mechanisms.edp_accounting import check_floor, describe, lowest_sigma
from dptext.privacy.mechanisms.edp_scaling import (ALPHA_FLOOR, SCALINGS, alphas_from_gradients,  # noqa: F401
                                                   check_alphas)  # (ALPHA_FLOOR re-exported)
from dptext.privacy.noise.randomness import RandomRoot, keyed_hash
from dptext.privacy.sampling.sampler import make_sampler


def hashed_slots(record_ids: Sequence[bytes], slots: int, key: bytes) -> list[int]:
    """Each record's slot as a keyed hash of its own id: independent of every other record and of its position."""
    return [keyed_hash(key, bytes(record_id)) % slots for record_id in record_ids]


# Adding or removing one example moves its slot's clipped gradient by up to 2C, whatever M and n are (see the
# module docstring: a factor chosen from n would make the mechanism itself depend on the data)
SENSITIVITY_FACTOR = 2


class EDPEngine:
    """eDP-SGD for ``model`` and ``optimizer``; the training-loop interface of ``PrivacyEngine`` plus clipping units.

    Per step: for each unit in ``clipping_units(indices)``, ``accumulate`` the per-example losses of its
    physical chunks (plain backward passes), then ``close_unit()`` clips it; ``step()`` adds the noise once.
    ``noise_multiplier`` is z_0 (noise std in units of C in the scaled space); the accountant's multiplier is
    ``accounting_noise_multiplier`` = z_0 / 2. ``verify`` (default True): the start-up probe runs before the
    model's first training forward, as PrivacyEngine's does (``probe_batch``/``probe_loss``: its inputs);
    ``verify=False`` opts out, and ``mechanism()`` says the clipping was not verified."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, noise_multiplier: float,
                 max_grad_norm: float, sample_rate: float, dataset_size: int, micro_batches_per_device: int = 1,
                 alphas: dict[nn.Parameter, float] | None = None, scaling: str | None = None,
                 schedule: NoiseSchedule = CONSTANT, steps_per_epoch: int = 1, seed: int | RandomRoot | None = None,
                 secure_rng: bool = False, ledger: Callable[..., Any] | None = None, distributed: Any = None,
                 record_ids: Sequence[bytes] | None = None, verify: bool = True,
                 probe_batch: Callable[..., Any] | None = None, probe_loss: Callable[..., Any] | None = None):
        """``record_ids``: one stable id per example (bytes; e.g. a digest of its content), for the keyed-hash
        slot rule; needed under torchrun unless every slot holds one example. ``seed``: see PrivacyEngine."""
        check_noise(noise_multiplier, max_grad_norm, floor=2 * MIN_SIGMA)  # accounted as z_0 / 2
        if micro_batches_per_device < 1:
            raise UserError("privacy.edp_micro_batches_per_device must be ≥ 1.")
        if scaling is None:  # α given without saying where it was measured: never claimed as covered
            scaling = "uniform" if alphas is None else "undeclared"
        elif scaling not in SCALINGS:
            raise UserError(f"edp scaling must be one of {', '.join(SCALINGS)}, not '{scaling}'.")
        check_alphas(alphas, scaling)
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise UserError("The model has no trainable parameters; unfreeze the layers to fine-tune.")
        _check_optimizer(optimizer, self.params)
        self.distributed = distributed if distributed is not None and distributed.active else None
        self.world_size = self.distributed.world_size if self.distributed else 1
        self.per_device = micro_batches_per_device
        self.slots = self.world_size * micro_batches_per_device
        self.sample_rate, self.dataset_size = float(sample_rate), dataset_size
        self._max_grad_norm = float(max_grad_norm)
        self._noise_multiplier = float(noise_multiplier)  # z_0
        self._factor = SENSITIVITY_FACTOR
        self.accounting_noise_multiplier = self.noise_multiplier / self.factor  # σ_0
        self.schedule, self.steps_per_epoch = schedule, steps_per_epoch
        self.scaling, self.alphas = scaling, alphas
        if alphas is not None and set(alphas) != set(self.params):
            raise UserError("eDP-SGD needs one scaling α per trainable parameter tensor.")
        self.secure_rng = secure_rng
        if secure_rng and seed is not None:
            raise UserError("secure_rng draws noise and sampling seeds from the operating system; drop the seed.")
        self.root = seed if isinstance(seed, RandomRoot) else RandomRoot(seed)
        rank = self.distributed.rank if self.distributed else 0
        self._set_slot_rule(record_ids, rank)
        self._record_step = getattr(ledger, "record_step", ledger)
        self._sampler, self.steps, self._unit_examples, self._left = None, 0, 0, None
        self.verified = False  # set by verify(): the synthetic probe matched brute force
        # verify_first False: the user opted out of the proof, and mechanism() says so
        self.verify_first, self._verifying, self._probe_args = bool(verify), False, (probe_batch, probe_loss)
        # the proof by default, as PrivacyEngine: before the first training forward, on synthetic inputs
        self._prove_hook = model.register_forward_pre_hook(self._prove_before_first_forward, prepend=True)
        # as PrivacyEngine: the optimizer updates only on privatized gradients (not a plain backward's raw ones)
        self._step_guard = optimizer.register_step_pre_hook(partial(refuse_foreign_step, self))
        self.dp_optimizer = DPOptimizer(
            optimizer, self.params, self.noise_multiplier, self.max_grad_norm, self.slots,
            NoiseSource(self.root, secure_rng, rank),
            reduce=self.distributed.all_reduce_sum if self.distributed else None,
            adds_noise=self.distributed is None or self.distributed.rank == 0, scale=alphas)

    # σ, C and the sensitivity factor define the guarantee: fixed for the life of the engine (SPEC §11)
    noise_multiplier = fixed_setting("noise_multiplier")
    max_grad_norm = fixed_setting("max_grad_norm")
    factor = fixed_setting("factor")

    def _set_slot_rule(self, record_ids: Sequence[bytes] | None, rank: int) -> None:
        """Slot = a keyed hash of the record id, or (no ids, one process) a fresh draw per step: a choice made by
        what the caller passes, never by n."""
        self.slot_rule, self.slot_table, self._slot_key = "draw_per_step", None, None
        self.slot_generator = self.root.generator("edp_slots", rank)
        if record_ids is not None:
            if len(record_ids) != self.dataset_size:
                raise UserError(f"eDP-SGD needs one record id per example ({self.dataset_size}), "
                                f"got {len(record_ids)}.")
            key = self.root.key("edp_slots")
            self._slot_key = self.distributed.broadcast(key) if self.distributed else key  # one key for all ranks
            self._record_ids = list(record_ids)
            self.slot_rule, self.slot_table = "keyed_hash", hashed_slots(self._record_ids, self.slots, self._slot_key)
        elif self.distributed:
            raise UserError("Distributed eDP-SGD assigns examples to ranks by a keyed hash of their record id; "
                            "pass record_ids (one stable id per example).")

    def slots_of(self, indices: list[int]) -> list[int]:
        """The slot of each sampled example this step (see the module docstring for the rule)."""
        if self.slot_rule == "keyed_hash":
            return [self.slot_table[index] for index in indices]
        return torch.randint(self.slots, (len(indices),), generator=self.slot_generator).tolist()

    def shard(self) -> list[int] | None:
        """The examples this rank owns under torchrun: those whose slot lives here (slot mod N = rank)."""
        if not self.distributed or self.slot_table is None:
            return self.distributed.shard(self.dataset_size) if self.distributed else None
        rank, world = self.distributed.rank, self.world_size
        return [i for i, slot in enumerate(self.slot_table) if slot % world == rank]

    def verify(self, make_batch=None, loss_fn=None, training_dtype=None, **options) -> None:
        """The start-up probe (``dptext.privacy.proof.edp_probe``): per-slot clipping against brute-force autograd on
        synthetic inputs (``make_batch(B, T, generator)``, ``loss_fn(model, batch)`` as for PrivacyEngine; without
        them those given to the constructor, else random token ids and a fixed functional of the output).
        ``training_dtype`` is PrivacyEngine's per-example check in that precision: a slot's examples share a clip."""
        make_batch, loss_fn = make_batch or self._probe_args[0], loss_fn or self._probe_args[1]
        self._verifying = True
        try:
            probe_edp(self, make_batch, loss_fn, **options)
        finally:
            self._verifying = False
        self._probe_args, self.verified = (make_batch, loss_fn), True

    def _prove_before_first_forward(self, module: nn.Module, args: tuple) -> None:
        """The model's first training forward (grad enabled, training mode) runs the probe first, unless the
        engine was verified or built with ``verify=False``; the probe's own forwards pass through."""
        if self.verified or not self.verify_first or self._verifying or not module.training \
                or not torch.is_grad_enabled():
            return
        self.verify()

    # ------------------------------------------------------------------ the training step
    def clipping_units(self, indices: list[int]) -> list[list[int]]:
        """This process's sampled ``indices`` grouped by their slot (empty slots dropped)."""
        groups: dict[int, list[int]] = {}
        for index, slot in zip(indices, self.slots_of(indices)):
            groups.setdefault(slot, []).append(index)
        return [groups[slot] for slot in sorted(groups)]

    def accumulate(self, per_example_loss: Tensor) -> None:
        """Backward pass of one physical chunk of the current micro-batch (gradients add up in .grad)."""
        refuse_mode_around("accumulate")
        if per_example_loss.ndim != 1:
            raise UserError("Pass one loss per example (a 1-D tensor), not a batch-averaged scalar.")
        if per_example_loss.numel() == 0:
            return
        self._check_grads()
        per_example_loss.float().sum().backward()
        self._unit_examples += per_example_loss.numel()
        self._left = grads_now(self.params)

    def _check_grads(self) -> None:
        """A backward the engine did not issue (over the whole batch, or between a unit's chunks) would join this
        unit's clip: an example would move two units, 4C where 2C is accounted. Refused, the unit dropped."""
        if not grads_as_left(self.params, self._left if self._unit_examples else None):
            self.zero_grad()
            raise UserError(FOREIGN_GRADIENT)

    def close_unit(self) -> float | None:
        """Clip the micro-batch accumulated since the last call: Δ/α clipped to C; returns its scaled norm."""
        refuse_mode_around("close_unit")  # (a mode could zero the norm: the unit would join unclipped)
        self._check_grads()
        count, self._unit_examples = self._unit_examples, 0
        if count == 0:
            return None
        with torch.no_grad():
            scaled = {}
            for param in self.params:
                if param.grad is not None:
                    grad = param.grad.float() / count
                    scaled[param] = grad / self.alphas[param] if self.alphas is not None else grad
                param.grad = None
            norm = torch.sqrt(sum(g.pow(2).sum() for g in scaled.values())) if scaled else torch.zeros(())
            coef = (self.max_grad_norm / (norm + STABILITY)).clamp(max=1.0)
            self.dp_optimizer.add_clipped_sums({p: g * coef for p, g in scaled.items()}, count)
        return float(norm)

    def noise_multiplier_at(self, step: int) -> tuple[float, float]:
        """(z_t, σ_t) for 0-based ``step``: the noise std in units of C, and the multiplier the ledger records."""
        sigma = self.schedule.sigma_at(self.accounting_noise_multiplier, step, self.steps_per_epoch)
        return sigma * self.factor, sigma

    def step(self, per_example_loss: Tensor | None = None) -> None:
        """Noise once in the scaled space, rescale by α, average over the M slots, update; accounts the step."""
        refuse_mode_around("step")
        if per_example_loss is not None:
            self.accumulate(per_example_loss)
        self.close_unit()
        z_t, sigma_t = self.noise_multiplier_at(self.steps)
        try:
            check_floor(self, sigma_t, self.steps)  # before the update: a step below the floor never happens
        except UserError:
            self.zero_grad()
            raise
        self.dp_optimizer.noise_multiplier = z_t
        self.dp_optimizer.step()
        self.steps += 1
        if self._record_step is not None:
            self._record_step(sample_rate=self.sample_rate, noise_multiplier=sigma_t)

    def zero_grad(self) -> None:
        self.dp_optimizer.zero_grad()
        self._unit_examples = 0
        for param in self.params:
            param.grad = None

    def clipped_grads(self) -> dict[nn.Parameter, Tensor]:
        """The clipped scaled-space sums of this step so far, before noise (tests and debugging)."""
        return dict(self.dp_optimizer.summed)

    # ------------------------------------------------------------------ sampling, accounting, state
    def sampler(self, steps: int):
        check_floor(self, *lowest_sigma(self, self.steps + steps))  # refused before the first step, not mid-run
        self._sampler = make_sampler(self.dataset_size, self.sample_rate, steps, self.root, "poisson",
                                     self.distributed, shard=self.shard())
        return self._sampler

    def mechanism(self) -> dict[str, Any]:
        """The guarantee and its unit, for the run summary and the ledger (``edp_accounting.describe``)."""
        return describe(self)

    def state_dict(self) -> dict[str, Any]:
        """Steps, the noise generators and the slot stream; the slot key too (the checkpoint is as secret as the
        data, see docs/privacy_engine.md), so a resumed run keeps every record in its slot."""
        return {**PrivacyEngine.state_dict(self), "slot_generator": self.slot_generator.get_state(),
                "slot_key": self._slot_key}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        PrivacyEngine.load_state_dict(self, state)
        if "slot_generator" in state:
            self.slot_generator.set_state(state["slot_generator"])
        if state.get("slot_key") is not None and self.slot_table is not None:
            self._slot_key = state["slot_key"]
            self.slot_table = hashed_slots(self._record_ids, self.slots, self._slot_key)
            if self.distributed and self._sampler is not None:  # this rank owns the examples of its slots
                self._sampler.shard = torch.tensor(self.shard(), dtype=torch.long)

    def detach(self) -> None:
        """Remove the proof's forward pre-hook and the optimizer's step guard (eDP-SGD uses plain autograd)."""
        self._prove_hook.remove()
        self._step_guard.remove()
