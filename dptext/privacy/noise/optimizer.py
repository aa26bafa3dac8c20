"""The DP optimizer: clipped sums in, one noisy step out (SPEC §1).

Per logical step the clipped per-example gradients of all micro-batches are summed, Gaussian noise
N(0, σ²C²) is added once, and the result is divided by the *expected* batch size B, never by the realised
one (that would leak the batch size). The wrapped torch optimizer (SGD → DP-SGD, Adam → DP-Adam, AdamW → …)
then steps on that gradient. A step whose Poisson batch is empty is valid: the gradient is noise / B.

Noise is drawn on each parameter's device from a ``torch.Generator`` seeded from the "noise" child of the run's
random root (``dptext.privacy.noise.randomness``): a secret root from ``os.urandom`` by default, a seed-derived one only
for reproducible research runs. It is never the sampler's stream. ``secure_rng=True`` goes further and re-seeds
every generator from ``os.urandom`` before every step (64 fresh bits per step and device), so even a leaked
generator state predicts at most one step — at the price of a resume that is no longer bit-exact. The limit:
torch's generators (Mersenne Twister on CPU, Philox on CUDA) are fast but not cryptographic, so neither option is
a CSPRNG stream; a stronger source would need a cryptographic generator producing Gaussian samples on the
device, which torch does not ship. On CPU the step's noise is drawn on all cores in fixed chunks, each seeded from
the device generator (``parallel_noise``): the same noise whatever the number of threads.
"""

from __future__ import annotations

from contextlib import contextmanager

import os
from typing import Callable

import torch
from torch import Tensor, nn

from dptext.privacy.noise.parallel_noise import normals
from dptext.privacy.noise.randomness import RandomRoot
from dptext.errors import UserError

OTHER_RANK_REFUSED = ("Another process's per-step privacy check failed in this logical batch (its own error says "
                      "which check and where); nothing from this batch was applied on any process.")


NOISE_GROUP = 1 << 22  # coordinates whose noise is drawn together: 16 MB of fp32, 4 chunks for the pool


def _groups(params: list[nn.Parameter], budget: int) -> list[list[nn.Parameter]]:
    """Consecutive parameters in groups of at most ``budget`` coordinates (a larger parameter alone)."""
    groups: list[list[nn.Parameter]] = [[]]
    size = 0
    for param in params:
        if groups[-1] and size + param.numel() > budget:
            groups.append([])
            size = 0
        groups[-1].append(param)
        size += param.numel()
    return [group for group in groups if group]


def random_seed() -> int:
    return int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)


class NoiseSource:
    """One generator per device from the root's "noise" child (stream k for the k-th device, ``rank`` for this
    process); when ``secure``, re-seeded from os.urandom before every step."""

    def __init__(self, root: RandomRoot, secure: bool = False, rank: int = 0):
        if secure and not root.secret:
            raise ValueError("secure_rng draws its seeds from the operating system; do not pass a seed as well")
        self.root = root
        self.rank = rank
        self.secure = secure
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = self.root.generator("noise", self.rank, device, stream=len(self._generators))
        return self._generators[device]

    def reseed_if_secure(self) -> None:
        if self.secure:
            for generator in self._generators.values():
                generator.manual_seed(random_seed())

    def state_dict(self) -> dict:
        """Each device generator's state, so a resumed run draws exactly the noise it would have drawn."""
        return {str(device): generator.get_state() for device, generator in self._generators.items()}

    def load_state_dict(self, state: dict) -> None:
        for device, generator_state in state.items():
            self.generator(torch.device(device)).set_state(generator_state)

    def normal(self, std: float, like: Tensor) -> Tensor:
        return self.normals(std, [like])[0]

    def normals(self, std: float, likes: list[Tensor]) -> list[Tensor]:
        """N(0, std²) shaped like each of ``likes`` (fp32), drawn on all cores on CPU (``parallel_noise``)."""
        out: list[Tensor | None] = [None] * len(likes)
        for device in dict.fromkeys(like.device for like in likes):  # devices in first-seen order: deterministic
            indices = [i for i, like in enumerate(likes) if like.device == device]
            for i, noise in zip(indices, normals(std, [likes[i] for i in indices], self.generator(device))):
                out[i] = noise
        return out


class DPOptimizer:
    """Wraps a torch optimizer: ``add_clipped_sums`` per micro-batch, then ``step`` once per logical batch."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], noise_multiplier: float,
                 max_grad_norm: float, expected_batch_size: float, noise: NoiseSource,
                 reduce: Callable[[dict], dict] | None = None, adds_noise: bool = True,
                 scale: dict[nn.Parameter, float] | None = None,
                 any_rank: Callable[[bool, torch.device], bool] | None = None):
        """``reduce`` sums the noisy sums over processes (dptext.privacy.sharding.distributed); ``adds_noise`` is
        False on every rank but 0 there, so the noise is drawn once. ``scale`` multiplies a parameter's noisy sum after
        the reduction (eDP-SGD's α_l: clipping and noise happen in the scaled space). ``any_rank`` (several
        processes) tells every rank whether any rank refused the logical batch (``refuse``, ``collective_verdict``)."""
        self.optimizer = optimizer
        self.params = params
        self.noise_multiplier = noise_multiplier
        self.max_grad_norm = max_grad_norm
        self.expected_batch_size = expected_batch_size
        self.noise = noise
        self.reduce = reduce
        self.adds_noise = adds_noise
        self.scale = scale
        self.any_rank = any_rank
        self.refusal: UserError | None = None  # this rank's failed per-step check, raised on every rank at the step
        self.summed: dict[nn.Parameter, Tensor] = {}
        self.param_names: dict[nn.Parameter, str] = {}  # for messages; the engine fills it
        self.examples_seen = 0  # realised examples in this logical batch: for logging only, never for scaling
        self.updating = False  # True only while step() runs the wrapped optimizer on the privatized gradients

    @contextmanager
    def engine_update(self):
        """The wrapped optimizer's step, on privatized gradients: the only update the engine lets through
        (``PrivacyEngine`` refuses any other step of that optimizer)."""
        self.updating = True
        try:
            yield
        finally:
            self.updating = False

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def refuse(self, error: UserError) -> None:
        """Several processes: this rank's per-step check failed. The logical batch is dropped, nothing joins it any
        more, and ``collective_verdict`` raises ``error`` here and on every other rank at the step, where they all
        meet; raising at once would leave the other ranks waiting in the step's collective for a rank that left."""
        self.zero_grad()
        self.refusal = error

    def collective_verdict(self) -> None:
        """At the step, before any update: every rank stops with nothing applied if any rank refused the batch. The
        refusal outlives ``zero_grad`` (a caller dropping the batch in between), so it surfaces here as one process
        would have raised it at once."""
        if self.any_rank is None:
            return
        if self.any_rank(self.refusal is not None, self.device()):
            refusal, self.refusal = self.refusal or UserError(OTHER_RANK_REFUSED), None
            self.zero_grad()
            raise refusal

    def device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    def in_logical_batch(self) -> bool:
        """Whether anything was accumulated (or refused) since the last step."""
        return bool(self.summed) or self.examples_seen > 0 or self.refusal is not None

    def add_clipped_sums(self, sums: dict[nn.Parameter, Tensor], examples: int) -> None:
        if self.refusal is not None:
            return
        for param, total in sums.items():
            total = total.to(device=param.device, dtype=torch.float32)
            self.summed[param] = self.summed[param] + total if param in self.summed else total
        self.examples_seen += examples

    def privatized_grads(self) -> dict[nn.Parameter, Tensor]:
        """(Σ_i ḡ_i + N(0, σ²C²)) / B for every parameter, in fp32; consumes the accumulated sums.

        Distributed: Σ_ranks (local clipped sum [+ the noise, on rank 0 only]) / B, the same on every rank."""
        self.collective_verdict()
        self.noise.reseed_if_secure()
        std = self.noise_multiplier * self.max_grad_norm if self.adds_noise else 0.0
        noisy_sums = {}
        # In place, and each clipped sum dropped once its noise is added: a model-sized copy at a time, not three
        # (the sums, the noisy sums and the grads all alive at once made this the peak of a book-keeping step).
        # The noise comes a group of parameters at a time (NOISE_GROUP coordinates, or one larger parameter), so
        # that the cores share the drawing while only one group's noise is alive next to the sums (a group of 2^25
        # held MiniLM-L6's whole model: +16 % peak memory).
        for group in _groups(self.params, NOISE_GROUP):
            noises = self.noise.normals(std, group) if std > 0 else \
                [torch.zeros_like(param, dtype=torch.float32) for param in group]
            for param, noisy in zip(group, noises):
                total = self.summed.pop(param, None)
                noisy_sums[param] = noisy if total is None else noisy.add_(total)
                del total
        if self.reduce is not None:
            noisy_sums = self.reduce(noisy_sums)
        if self.scale is not None:
            noisy_sums = {param: total.mul_(self.scale[param]) for param, total in noisy_sums.items()}
        grads = {param: total.div_(self.expected_batch_size) for param, total in noisy_sums.items()}
        self.zero_grad()
        return grads

    def check_owned(self) -> None:
        """The optimizer must update nothing but the planned parameters (issue 23): a parameter added later with
        ``add_param_group``, or one that requires grad / holds a ``.grad`` outside the plan, would get its raw
        gradient. Stops before the update and drops the logical batch."""
        planned = set(self.params)
        for index, group in enumerate(self.optimizer.param_groups):
            for param in group["params"]:
                if param not in planned and (param.requires_grad or param.grad is not None):
                    self.zero_grad()
                    what = f"'{self.param_names[param]}'" if param in self.param_names else \
                        f"of shape {tuple(param.shape)}"
                    raise UserError(f"The optimizer's param group {index} holds a parameter {what} that the "
                                    "privacy engine did not plan, so it would get a raw gradient; call "
                                    "engine.replan() after add_param_group or unfreezing (it re-runs the probe), "
                                    "or freeze it.")

    def step(self) -> None:
        self.check_owned()
        for param, grad in self.privatized_grads().items():
            param.grad = grad.to(param.dtype)
        with self.engine_update():
            self.optimizer.step()
        for param in self.params:
            param.grad = None  # the optimizer's grads are ours; nothing stale may leak into the next step

    def zero_grad(self) -> None:
        self.summed = {}
        self.examples_seen = 0

    def accumulated(self) -> dict[nn.Parameter, Tensor]:
        """The clipped sums accumulated so far in this logical batch, before noise."""
        return dict(self.summed)

    def release(self) -> None:
        """Undo what this optimizer changed outside itself (``engine.detach``); nothing here."""

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
