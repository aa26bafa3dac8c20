"""``PrivacyEngine``: DP training for a model and optimizer you already have (SPEC §1–2).

One object ties the whole privatized step together (jax_privacy's execution plan): the sampler that draws
the batches (Poisson with rate q), per-example clipping (C, the clipping mode and layout), the noise (σ) and
the count of steps, so the numbers the accountant needs (``sample_rate``, ``noise_multiplier``, ``steps``) are
those of the sampler and noise that really ran.

Privacy settings: noise_multiplier σ, max_grad_norm C, sample_rate q (or expected batch size B = qn),
the sampler (Poisson only: shuffling is not what the accountant covers, so it is refused), and the randomness:
sampler and noise draw from separate children of one root (``dptext.privacy.noise.randomness``), secret by default.
Settings that do not change privacy: clipping_mode, clipping_layout's implementation, micro-batch size, dtype.

Clipping modes (same clipped sums, different cost):
* ``bookkeeping`` (default): one backward pass. The engine's parameters are taken out of autograd
  (requires_grad=False, so autograd skips their weight-gradient GEMMs while activation gradients still flow);
  hooks keep each layer's activation and output gradient, give every per-example norm (mixed ghost/instantiated
  rule per layer) and then the clipped sums as (c ⊙ g)ᵀ a.
* ``ghost``: two backward passes (Li et al.): the first gives the norms, the second differentiates Σ_i c_i·loss_i
  with ordinary autograd. All-layer clipping only.
* ``per_sample``: instantiates per-example gradients (the opacus way); the memory-hungry reference.
* long sequences: ``max_stored_bytes`` gives book-keeping's layers over it ghost's treatment (``clipping/hybrid``).

Fail closed (docs/privacy_engine.md): ``verify()`` runs the synthetic start-up probe against brute-force
autograd; every step the records must cover exactly the planned parameters (``replan()`` after changing what is
trained) and the clipped sums must satisfy the per-step invariant, or the step stops before the update.

The rooms: ``clipping/`` (plan, rules' use, one micro-batch per mode), ``proof/`` (the start-up probe and the
every-step checks), ``noise/``, ``sampling/``, ``sharding/``; ``settings`` and ``engine_plan`` beside this file.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
from torch import Tensor, nn

from dptext.accounting import StepRun, compute_epsilon
from dptext.errors import UserError
from dptext.privacy.clipping.clipped_step import backward_once, clip_recorded, exact_arithmetic, ghost_backward
from dptext.privacy.clipping import hybrid, long_sequences
from dptext.privacy.clipping.call_checks import refuse_mode_around
from dptext.privacy.noise.optimizer import DPOptimizer, NoiseSource
from dptext.privacy.clipping.plan import _sampling_numbers
from dptext.privacy.engine_plan import install_plan, remove_plan
from dptext.privacy.noise.randomness import RandomRoot
from dptext.privacy.sampling.sampler import make_sampler
from dptext.privacy.sharding.fsdp_controls import check_no_other_ghost_engine
from dptext.privacy.sharding.row_reduce import sum_chunks
from dptext.privacy.sharding.sharded import check_sharded_context, sharded_optimizer
from dptext.privacy.proof.step_checks import (check_loss, check_no_foreign_backward, check_trainable_set,
                                               check_hooks_as_planned, parameter_names, refuse_foreign_step)
from dptext.privacy.settings import check_settings, describe_mechanism, fixed_setting, target_noise_multiplier
from dptext.privacy.clipping.units import LogicalBatchUnits, unit_index
from dptext.privacy.sampling.user_sampler import UserPoissonSampler, make_user_sampler
from dptext.privacy.proof.probe_model import needs_proof
from dptext.privacy.proof.adopt import adopt_proof
from dptext.privacy.proof.verify import ProbeReport, probe as verify_probe


class PrivacyEngine:
    """Privatizes the training of ``model`` by ``optimizer``; see the module docstring and docs/privacy_engine.md.

    Give the sampling as ``sample_rate`` q and ``dataset_size`` n (B = qn), or ``expected_batch_size`` B with
    either of them. Sampler and noise come from independent children of one random root: by default a secret
    root drawn from ``os.urandom`` (never written anywhere); ``seed`` (an int or a ``RandomRoot``) makes them
    reproducible, and then the guarantee holds only while the seed stays secret (``mechanism()`` says so).
    ``secure_rng=True`` also re-seeds the noise from the OS before every step. ``ledger``, a ``PrivacyLedger``
    (its ``record_step``) or any callable, is called as ``record_step(sample_rate=q, noise_multiplier=σ)`` after
    every noisy step. ``distributed``, a ``privacy.sharding.distributed.DistributedContext``, makes it one of N
    processes (torchrun): its sampler covers this rank's shard, sums are all-reduced and rank 0 adds the noise.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, noise_multiplier: float,
                 max_grad_norm: float, sample_rate: float | None = None, dataset_size: int | None = None,
                 expected_batch_size: float | None = None, clipping_mode: str = "bookkeeping",
                 clipping_layout: str = "all_layer", sampling: str = "poisson", seed: int | RandomRoot | None = None,
                 secure_rng: bool = False, ledger: Callable[..., Any] | None = None, distributed: Any = None,
                 verify: bool | ProbeReport = True, probe_batch: Callable[..., Any] | None = None,
                 probe_loss: Callable[..., Any] | None = None, max_stored_bytes: float | None = None,
                 sequence_length: int | None = None):
        self.sample_rate, self.dataset_size, self.expected_batch_size = _sampling_numbers(
            sample_rate, dataset_size, expected_batch_size)
        check_settings(clipping_mode, clipping_layout, sampling, noise_multiplier, max_grad_norm, seed, secure_rng)
        self.max_stored_bytes, self.sequence_length = long_sequences.check_settings(
            max_stored_bytes, sequence_length, clipping_mode, clipping_layout, distributed)
        self.model = model
        self._noise_multiplier = float(noise_multiplier)
        self._max_grad_norm = float(max_grad_norm)
        self.clipping_mode = clipping_mode
        self.clipping_layout = clipping_layout
        self.sampling = sampling
        self.secure_rng = secure_rng
        self.root = seed if isinstance(seed, RandomRoot) else RandomRoot(seed)
        self.rank = distributed.rank if distributed is not None and distributed.active else 0
        self._record_step = getattr(ledger, "record_step", ledger)
        self.steps = 0
        self.batch_units = LogicalBatchUnits()
        self.max_examples_per_user: int | None = None  # set by user_sampler(): ε is then about users
        self.distributed = check_sharded_context(model, distributed if distributed and distributed.active else None)

        self.optimizer = optimizer
        self.verified, self.proven_modes = False, None  # by verify(): proven on this plan, in these train/eval flags
        self.probe_compared: set | None = None  # while the probe runs: the parameters whose sums it compares
        self.verify_first, self._verifying = bool(verify), False  # False: the user opted out; mechanism() says so
        self._probe_args: tuple = (probe_batch, probe_loss)
        self._learned_layouts: dict = {}  # FunctionalRule per layer: what the probe learned survives replan()
        if self.distributed is not None and self.distributed.sharded and clipping_mode == "ghost":
            check_no_other_ghost_engine(model)  # before any hook is attached
        self._plan()
        if self.distributed is not None and self.distributed.sharded:  # FSDP2: each rank noises its own rows
            self.dp_optimizer = sharded_optimizer(self, optimizer, secure_rng)
        else:
            self.dp_optimizer = DPOptimizer(optimizer, self.params, self.noise_multiplier, self.max_grad_norm,
                                            self.expected_batch_size, NoiseSource(self.root, secure_rng, self.rank),
                                            reduce=self.distributed.all_reduce_sum if self.distributed else None,
                                            adds_noise=self.distributed is None or self.distributed.rank == 0,
                                            any_rank=self.distributed.any_rank if self.distributed else None)
        self.dp_optimizer.param_names = self.param_names()
        # the optimizer handed to the engine updates only on the engine's privatized gradients, in every mode (a
        # plain loss.backward() + optimizer.step() in ghost mode applied raw, unclipped gradients)
        self._step_guard = optimizer.register_step_pre_hook(partial(refuse_foreign_step, self))
        if isinstance(verify, ProbeReport):  # a proof made on these modules before fully_shard
            adopt_proof(self, verify)

    # σ and C: one value for the noise, the per-step invariant, mechanism() and the ledger, fixed at construction
    noise_multiplier = fixed_setting("noise_multiplier")
    max_grad_norm = fixed_setting("max_grad_norm")

    def _prove_before_first_forward(self, module: nn.Module, args: tuple) -> None:
        """The model's first training forward (with gradients, while the engine records) runs the start-up probe
        first, on synthetic inputs, unless the engine was verified or built with ``verify=False``: the proof is
        the default in the library as in ``dptext finetune``, and happens before any private example is read."""
        if self.verify_first and not self._verifying and not self.recorder.probing and self.recorder.active() \
                and needs_proof(self):  # not the probe's own forwards; not yet proven in these train/eval flags
            self.verify(*self._probe_args)

    def _plan(self) -> None:
        """Find the trainable layers and their rules, install the hooks, take the parameters out of autograd."""
        install_plan(self, self._prove_before_first_forward)

    def param_names(self) -> dict[nn.Parameter, str]:
        """Each parameter's dotted name in the model (for messages)."""
        return parameter_names(self.model)

    def replan(self, verify: bool = True, make_batch=None, loss_fn=None) -> None:
        """Re-plan after the trainable set changed (a layer unfrozen, a head replaced, ``add_param_group``).

        Call it between logical steps. With ``verify`` the synthetic probe re-verifies the new plan (with the
        arguments of the last ``verify()`` unless new ones are given); nothing is trusted from the old plan."""
        mid_batch = self.dp_optimizer.in_logical_batch()
        if self.dp_optimizer.any_rank is not None:  # every rank decides alike: re-planning gathers sharded weights
            mid_batch = self.dp_optimizer.any_rank(mid_batch, self.dp_optimizer.device())
        if mid_batch:
            raise UserError("replan() was called in the middle of a logical batch; call it after step().")
        remove_plan(self, replanning=True)
        self._plan()
        self.dp_optimizer.params = self.params
        if hasattr(self.dp_optimizer, "chunks"):  # FSDP2: the chunks reduce-scattered follow the new plan
            self.dp_optimizer.chunks = sum_chunks(self.tracked, self.params)
        self.dp_optimizer.param_names = self.param_names()
        self.verified = False
        if verify:
            self.verify(make_batch, loss_fn)  # falls back to the last verify()'s arguments

    def verify(self, make_batch=None, loss_fn=None, **options):
        """Run the start-up probe (``dptext.privacy.proof.verify.probe``) on synthetic inputs; refuse on any mismatch.

        Returns the per-layer report; ``replan()`` re-runs it with the same arguments. Without ``make_batch`` and
        ``loss_fn``: the constructor's ``probe_batch`` and ``probe_loss``, else random ids and a fixed functional of
        the output. Hooks changed since the plan are refused: the steps would refuse what it proved (``replan()``)."""
        make_batch, loss_fn = make_batch or self._probe_args[0], loss_fn or self._probe_args[1]
        check_hooks_as_planned(self)
        self._verifying = True
        try:
            report = verify_probe(self, make_batch, loss_fn, **options)
        finally:
            self._verifying = False
        self._probe_args = (make_batch, loss_fn)
        report.raise_if_refused()
        self.verified, self.proven_modes, self.proven_autocast = True, report.modes, report.training_dtype
        self.recorder.verified = set(self.tracked)
        return report

    # ------------------------------------------------------------------ the training step

    def _exact_arithmetic(self):
        return exact_arithmetic(self)

    def accumulate(self, per_example_loss: Tensor, units: Tensor | None = None) -> Tensor:
        """Backward pass for one (micro-)batch: adds its clipped per-example gradients to the logical batch.

        ``units`` (user-level DP): the privacy unit of each example; each unit's summed gradient is clipped to C as
        one vector (``privacy/clipping/units.py``), and all of a unit's examples must come in one call. None: one
        unit per example. Returns the whole-model gradient norms before clipping (for logging): one per unit in
        sorted id order, or per example in batch order where every unit is one example."""
        check_loss(self, per_example_loss, units)
        unit_ids = unit_index(units, per_example_loss.numel(), per_example_loss.device)  # checked before recorded
        self.batch_units.add(units, per_example_loss.numel())
        if per_example_loss.numel() == 0:
            self.recorder.take_uses()
            return per_example_loss.detach().float()
        check_no_foreign_backward(self)
        if self.clipping_mode == "ghost":
            return ghost_backward(self, per_example_loss, unit_ids)
        if self.ghost_modules:  # book-keeping with layers under the ghost treatment (long sequences)
            return hybrid.hybrid_backward(self, per_example_loss, unit_ids)
        backward_once(self, per_example_loss)
        return clip_recorded(self, per_example_loss, unit_ids)

    def step(self, per_example_loss: Tensor | None = None) -> None:
        """One logical DP step: optionally ``accumulate(per_example_loss)``, then noise once and update.

        Calling it with nothing accumulated is the step of an empty Poisson batch: noise only."""
        refuse_mode_around("step")  # (a mode around the noise draw could zero it)
        if per_example_loss is not None:
            self.accumulate(per_example_loss)
        check_trainable_set(self)
        self.batch_units.reset()
        self.dp_optimizer.step()
        self.steps += 1
        if self._record_step is not None:
            self._record_step(sample_rate=self.sample_rate, noise_multiplier=self.noise_multiplier)

    def zero_grad(self) -> None:
        """Drop what was accumulated for the current logical batch."""
        self.dp_optimizer.zero_grad()
        self.batch_units.reset()
        self.recorder.take_uses()
        self.outside_reads.clear()

    def clipped_grads(self) -> dict[nn.Parameter, Tensor]:
        """The clipped sums accumulated so far in this logical batch, before noise (for tests and debugging)."""
        return self.dp_optimizer.accumulated()

    # ------------------------------------------------------------------ sampling and accounting

    def sampler(self, steps: int):
        """The batch sampler this engine is accounted for: ``steps`` batches of dataset indices, drawn from the
        root's "sampler" child (independent of the noise)."""
        if self.dataset_size is None:
            raise UserError("The engine needs dataset_size to sample batches.")
        return make_sampler(self.dataset_size, self.sample_rate, steps, self.root, self.sampling, self.distributed)

    def user_sampler(self, users: list[list[int]], max_examples_per_user: int, steps: int) -> UserPoissonSampler:
        """User-level Poisson batches (``privacy/sampling/user_sampler.py``) at this engine's rate, from its sampler
        stream: the engine's dataset_size must count users (q is over users); pass each batch's ``users`` as
        ``units``."""
        if self.dataset_size != len(users):
            raise UserError(f"The engine is accounted for {self.dataset_size} units but {len(users)} users were "
                            "given; build it with dataset_size = the number of users (q is over users).")
        self.max_examples_per_user = max_examples_per_user
        return make_user_sampler(users, self.sample_rate, steps, max_examples_per_user, self.root)

    @classmethod
    def from_target_epsilon(cls, model: nn.Module, optimizer: torch.optim.Optimizer, *, target_epsilon: float,
                            delta: float, steps: int, max_grad_norm: float, sample_rate: float | None = None,
                            dataset_size: int | None = None, expected_batch_size: float | None = None,
                            accountant: str = "rdp", **options: Any) -> "PrivacyEngine":
        """An engine whose σ is calibrated so that ``steps`` steps spend ``target_epsilon`` at ``delta``.

        ``accountant`` (rdp, prv or pld: one that gives a bound; GDP's CLT approximation is refused) calibrates;
        ask ``epsilon(delta, accountant)`` of the same one. Other ``options`` are those of the constructor
        (clipping_mode, seed, ledger, ...)."""
        sigma = target_noise_multiplier(target_epsilon, delta, steps, accountant, sample_rate, dataset_size,
                                        expected_batch_size)
        return cls(model, optimizer, noise_multiplier=sigma, max_grad_norm=max_grad_norm, sample_rate=sample_rate,
                   dataset_size=dataset_size, expected_batch_size=expected_batch_size, **options)

    def epsilon(self, delta: float, accountant: str = "rdp") -> float:
        """ε spent at ``delta`` by the steps this engine has taken (counted across ``load_state_dict``).

        The RDP bound by default; ``prv`` gives its upper bound and ``gdp`` its CLT approximation (not a bound).
        """
        result = compute_epsilon(accountant, [StepRun(self.sample_rate, self.noise_multiplier, self.steps)], delta)
        return result.epsilon if result.approximate else result.guaranteed

    def accounting(self) -> dict[str, Any]:
        """What the accountant needs: the sampled Gaussian mechanism run so far."""
        return {"sample_rate": self.sample_rate, "noise_multiplier": self.noise_multiplier, "steps": self.steps,
                "sampling": self.sampling, "matches_accounting": self.sampling == "poisson"}

    def mechanism(self) -> dict[str, Any]:
        """What the guarantee is about: its unit, the sensitivity, where the noise is added (``settings``)."""
        return describe_mechanism(self)

    def state_dict(self) -> dict[str, Any]:
        """Steps taken and the noise generators' states (the wrapped optimizer is saved by its owner)."""
        return {"steps": self.steps, "noise": self.dp_optimizer.noise.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = state["steps"]
        self.dp_optimizer.noise.load_state_dict(state["noise"])

    def detach(self) -> None:
        """Remove the hooks, give the parameters back to autograd and FSDP2 its own gradient reduction."""
        self._step_guard.remove()
        self.dp_optimizer.release()
        remove_plan(self, replanning=False)
