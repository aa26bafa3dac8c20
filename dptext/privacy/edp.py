"""eDP-SGD (Dupuy et al. 2021, Algorithm 1) with the privacy fixes of SPEC §4.

The clipping unit is a *micro-batch*, not an example: its mean gradient Δ_m is computed by ordinary autograd
(one backward pass, no per-example work — the method's whole speed-up), scaled per parameter tensor by 1/α_l,
clipped as one vector to norm C, and summed. Once per step Gaussian noise N(0, (C·z_t)²) is added to that sum
*in the scaled space*, then each parameter is multiplied back by α_l (so layer l's noise has std α_l·C·z_t) and
divided by the constant number of micro-batch slots M.

Micro-batch membership is fixed by index, independently of the data: with N processes and K micro-batches per
process (``micro_batches_per_device``) there are M = N·K slots and example i belongs to slot i mod M (on rank
i mod N). Each step Poisson-samples every example with rate q; slot m's micro-batch is its sampled examples.
Adding or removing one example therefore changes only its own slot's micro-batch, whose clipped gradient moves
by at most 2C (both versions have norm ≤ C). Chunking a Poisson batch sequentially would not have this
property: one more example shifts every later chunk.

Accounting: the sampled Gaussian mechanism with rate q and noise multiplier σ_t = z_t / 2 (noise std C·z_t over
sensitivity 2C), or σ_t = z_t when every slot holds at most one example (M ≥ n: ordinary DP-SGD). The noise
decays by epoch: z_t = z_0·d(t), t = ⌊step / steps_per_epoch⌋ with steps_per_epoch = round(1/q), d = 1,
1/(1+τt) or e^{−τt} (``dptext.accounting.schedule``, the same code the accountant composes). The ledger records
each step's σ_t, so its ε is that of ``dptext account --sigma σ_0 --schedule ...``.

Scaling α (one per parameter tensor): uniform (α = 1), measured on a public batch (no privacy cost), or
measured on the first private examples ("first_step", as the paper does) — a data-dependent choice the (ε, δ)
does not cover, so it is labelled as leaking. Measured α are the per-tensor gradient norms normalised to
root-mean-square 1, floored at ``ALPHA_FLOOR``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor, nn

from dptext.accounting.schedule import CONSTANT, NoiseSchedule
from dptext.errors import UserError
from dptext.privacy.clipping import STABILITY
from dptext.privacy.engine import PrivacyEngine, _check_optimizer
from dptext.privacy.optimizer import DPOptimizer, NoiseSource, random_seed
from dptext.privacy.sampler import make_sampler

SCALINGS = ("uniform", "public", "first_step")
ALPHA_FLOOR = 1e-3


def slot_of(index: int, slots: int) -> int:
    """The fixed micro-batch slot of example ``index``: index mod M (independent of the data and the sample)."""
    return index % slots


def sensitivity_factor(slots: int, dataset_size: int) -> int:
    """2 (sensitivity 2C) unless every slot owns at most one example, when eDP-SGD is ordinary DP-SGD."""
    return 1 if slots >= dataset_size else 2


def alphas_from_gradients(grads: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, float]:
    """α_l ∝ ‖grad_l‖, normalised to root-mean-square 1 over the parameter tensors, floored at ALPHA_FLOOR."""
    norms = {param: float(grad.float().norm()) for param, grad in grads.items()}
    rms = math.sqrt(sum(n * n for n in norms.values()) / max(len(norms), 1))
    if not rms > 0 or not math.isfinite(rms):
        raise UserError("The gradient that sets eDP-SGD's scaling α is zero or not finite; use more (or other) "
                        "examples for it, or privacy.edp_scaling=uniform.")
    return {param: max(n / rms, ALPHA_FLOOR) for param, n in norms.items()}


class EDPEngine:
    """eDP-SGD for ``model`` and ``optimizer``; the training-loop interface of ``PrivacyEngine`` plus clipping units.

    Per step: for each unit in ``clipping_units(indices)``, ``accumulate`` the per-example losses of its
    physical chunks (plain backward passes), then ``close_unit()`` clips it; ``step()`` adds the noise once.
    ``noise_multiplier`` is z_0 (noise std in units of C in the scaled space); the accountant's multiplier is
    ``accounting_noise_multiplier`` = z_0 / 2 (or z_0 when each slot holds one example).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, noise_multiplier: float,
                 max_grad_norm: float, sample_rate: float, dataset_size: int, micro_batches_per_device: int = 1,
                 alphas: dict[nn.Parameter, float] | None = None, scaling: str = "uniform",
                 schedule: NoiseSchedule = CONSTANT, steps_per_epoch: int = 1, seed: int | None = None,
                 secure_rng: bool = False, ledger: Callable[..., Any] | None = None, distributed: Any = None):
        if noise_multiplier < 0 or max_grad_norm <= 0:
            raise UserError("noise_multiplier must be ≥ 0 and max_grad_norm > 0.")
        if micro_batches_per_device < 1:
            raise UserError("privacy.edp_micro_batches_per_device must be ≥ 1.")
        if scaling not in SCALINGS:
            raise UserError(f"edp scaling must be one of {', '.join(SCALINGS)}, not '{scaling}'.")
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
        self.max_grad_norm = float(max_grad_norm)
        self.noise_multiplier = float(noise_multiplier)  # z_0
        self.factor = sensitivity_factor(self.slots, dataset_size)
        self.accounting_noise_multiplier = self.noise_multiplier / self.factor  # σ_0
        self.schedule, self.steps_per_epoch = schedule, steps_per_epoch
        self.scaling = scaling
        self.alphas = alphas
        if alphas is not None and set(alphas) != set(self.params):
            raise UserError("eDP-SGD needs one scaling α per trainable parameter tensor.")
        self.secure_rng = secure_rng
        self.seed = None if secure_rng else (0 if seed is None else seed)
        self._record_step = getattr(ledger, "record_step", ledger)
        self.steps = 0
        self._unit_examples = 0
        self.dp_optimizer = DPOptimizer(
            optimizer, self.params, self.noise_multiplier, self.max_grad_norm, self.slots,
            NoiseSource(self.seed, secure_rng), reduce=self.distributed.all_reduce_sum if self.distributed else None,
            adds_noise=self.distributed is None or self.distributed.rank == 0, scale=alphas)

    # ------------------------------------------------------------------ the training step
    def clipping_units(self, indices: list[int]) -> list[list[int]]:
        """This process's sampled ``indices`` grouped by their fixed slot (empty slots dropped)."""
        groups: dict[int, list[int]] = {}
        for index in indices:
            groups.setdefault(slot_of(index, self.slots), []).append(index)
        return [groups[slot] for slot in sorted(groups)]

    def accumulate(self, per_example_loss: Tensor) -> None:
        """Backward pass of one physical chunk of the current micro-batch (gradients add up in .grad)."""
        if per_example_loss.ndim != 1:
            raise UserError("Pass one loss per example (a 1-D tensor), not a batch-averaged scalar.")
        if per_example_loss.numel() == 0:
            return
        per_example_loss.float().sum().backward()
        self._unit_examples += per_example_loss.numel()

    def close_unit(self) -> float | None:
        """Clip the micro-batch accumulated since the last call: Δ/α clipped to C; returns its scaled norm."""
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
        if per_example_loss is not None:
            self.accumulate(per_example_loss)
        self.close_unit()
        z_t, sigma_t = self.noise_multiplier_at(self.steps)
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
    def sampler(self, steps: int, generator_seed: int | None = None):
        seed = random_seed() if self.secure_rng else (generator_seed if generator_seed is not None else self.seed)
        return make_sampler(self.dataset_size, self.sample_rate, steps, seed, "poisson", self.distributed)

    def mechanism(self) -> dict[str, Any]:
        """The guarantee and its unit, for the run summary and the ledger."""
        one_each = self.factor == 1
        leaks = self.scaling == "first_step"
        guarantee = (f"example-level (ε, δ); clipping unit: micro-batch, sensitivity {self.factor}C "
                     f"(accounted σ_t = z_t/{self.factor})")
        if leaks:
            guarantee += "; α measured on private data is NOT covered"
        return {"method": "edp_sgd", "unit": "micro-batch (slot i mod M, fixed by index)",
                "sensitivity": self.factor * self.max_grad_norm, "sensitivity_factor": self.factor,
                "guarantee": guarantee, "processes": self.world_size, "micro_batches_per_device": self.per_device,
                "slots": self.slots, "z0": self.noise_multiplier,
                "accounting_noise_multiplier_0": self.accounting_noise_multiplier,
                "noise_schedule": self.schedule.describe(), "steps_per_epoch": self.steps_per_epoch,
                "scaling": self.scaling, "scaling_leaks": leaks,
                "noise": "N(0, (C·z_t)²) in the scaled space once per step" + (
                    " on rank 0" if self.world_size > 1 else "") + ", then ×α_l"}

    state_dict = PrivacyEngine.state_dict  # steps and the noise generators, as for DP-SGD
    load_state_dict = PrivacyEngine.load_state_dict

    def detach(self) -> None:
        """Nothing to remove: eDP-SGD uses plain autograd, no hooks."""
