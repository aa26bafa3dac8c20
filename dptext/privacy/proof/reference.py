"""The probe's reference: plain per-example autograd, without the engine's hooks, for the compared parameters.

It is the brute force the engine's norms and clipped sums are checked against (``probe_checks.compare``): one
autograd pass per example's loss over a retained graph, each example's gradient folded into the clipped sums as
soon as it is taken. A reference that fails or is not finite itself is ``ReferenceFailed``: nothing can be proven.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dptext.privacy.clipping import sums as clipping
from dptext.privacy.proof.sharded_probe import dealt, raise_on_every_rank, view_of
from dptext.privacy.sharding.row_reduce import reduce_to_own_rows


@contextmanager
def same_randomness(device: torch.device):
    """Every forward of the probe draws the same dropout masks."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(20240601)
        yield


class ReferenceFailed(RuntimeError):
    """Plain per-example autograd itself fails or is not finite on the synthetic batch (Longformer's fp32 softmax
    mask turns into -inf in fp64; an input changed in place after a layer read it): nothing to compare against.
    The probe retries in the model's own dtype, then refuses."""


@contextmanager
def requiring_grad(params: list[nn.Parameter]):
    """Every planned parameter requires grad inside (book-keeping keeps them out of autograd), as it was after."""
    was = [p.requires_grad for p in params]
    try:
        for param in params:
            param.requires_grad_(True)
        yield
    finally:
        for param, flag in zip(params, was):
            param.requires_grad_(flag)


class Reference:
    """Plain per-example autograd without the engine's hooks, for one probe batch: the loss, each example's squared
    gradient norm per compared parameter, and Σ_i c_i·g_i with the engine's C and layout.

    ``examples`` (None: every one) are the examples whose gradients are taken; the engine's pass weighted the
    others' losses by 0, so their exact gradient is 0, which is what they count as here (``probe_checks``).
    ``params`` are the parameters compared (those of one representative layer per use pattern,
    ``dptext.privacy.proof.patterns``); ``other_norms_sq`` the engine's per-example squared norms of the rest,
    which complete each example's whole-model norm in the all-layer layout (they come from the same rules on the
    same code paths as the representatives', whose norms are compared here). A coefficient needs only its own
    example's norms, so each example's gradient is folded into the sums as soon as it is taken and dropped:
    holding all of them (B model-sized fp64 copies) made the probe's peak 14.8 fp32 model sizes on a random
    36M-parameter Llama, 9.2 without (``benchmarks/probe_memory.py``)."""

    def __init__(self, engine, batch, loss_fn, device, params: list[nn.Parameter],
                 other_norms_sq: dict[nn.Parameter, Tensor] | None = None, examples: set[int] | None = None,
                 share: tuple[int, int] | None = None):
        params = list(params)
        view = view_of(engine)  # sharded: differentiate what the layers compute with, the gathered parameters,
        targets = [view.target(p) for p in params] if view is not None else params  # and see any path through a
        shards = list(engine.params) if view is not None else []  # shard itself (``full_tensor()`` outside a pass)
        self.shard_reads: set[Tensor] = set()
        others = other_norms_sq or {}
        squares: list[dict[nn.Parameter, Tensor]] = []
        self.params = params
        self.sums: list[Tensor] = []  # formed from the first compared example's gradient: no zero-filled copy
        with requiring_grad(list(dict.fromkeys(params + targets + shards))):
            with engine.recorder.paused(), same_randomness(device):
                loss = loss_fn(engine.model, batch)
            self.loss = loss.detach()
            uncounted = None
            if share is not None and loss.ndim == 1:  # dealt out among the examples the loss has: a loss of
                examples, uncounted = shared_examples(  # fewer entries than the batch (refused for its shape) must
                    sorted(e for e in examples if e < len(loss)), *share)  # not leave one rank a pass short
            for i in range(len(loss) if loss.ndim == 1 else 0):
                if examples is not None and i not in examples:  # weighted 0 in the engine's pass: its exact
                    squares.append({p: loss.new_zeros(1, dtype=torch.float64) for p in params})  # gradient is 0
                    if i == uncounted:  # a sharded rank with no example of its own: the backward is a collective
                        _example_gradient(loss[i], targets, shards, set())
                    continue
                row = _example_gradient(loss[i], targets, shards, self.shard_reads)
                norms = {p: squared_norm(g) for g, p in zip(row, params)}
                if not all(bool(torch.isfinite(n)) for n in norms.values()):
                    raise ReferenceFailed("non-finite losses or gradients")
                whole = {**norms, **{p: n[i:i + 1].double() for p, n in others.items() if p not in norms}}
                coef, _ = clipping.clip_coefficients(whole, engine.max_grad_norm, engine.clipping_layout,
                                                     len(engine.params))
                for k, (g, p) in enumerate(zip(row, params)):
                    if k == len(self.sums):
                        self.sums.append(g.to(reference_dtype(p)) * float(coef[p]))
                    else:
                        self.sums[k].add_(g.to(self.sums[k].dtype), alpha=float(coef[p]))
                squares.append(norms)
        self.sums += [torch.zeros(t.shape, dtype=reference_dtype(p), device=t.device)  # (t: p's whole shape)
                      for p, t in list(zip(params, targets))[len(self.sums):]]
        self.norms_sq = {p: torch.cat([each[p] for each in squares]) if squares else None for p in params}
        self._shards = shards
        self.sum_norms: list[float] | None = None  # sharded, summed over the ranks: each sum's whole norm
        if not bool(torch.isfinite(self.loss).all()):
            raise ReferenceFailed("non-finite losses or gradients")


    def add_over_ranks(self, engine) -> None:
        """Sharded, the ranks having shared the examples (``reference_gradients``): the norms and clipped sums
        summed over the ranks (each example was counted on one rank, the others count 0 there) — of each sum,
        this rank's rows, and its whole norm — and the shards any rank's backward reached."""
        with_norms = [p for p in self.params if self.norms_sq[p] is not None]
        if with_norms:
            norms = torch.stack([self.norms_sq[p] for p in with_norms])
            dist.all_reduce(norms)
            self.norms_sq.update({p: norms[k] for k, p in enumerate(with_norms)})
        view = view_of(engine)  # each rank compares its own rows of each sum (``probe_checks.sum_error``): it
        self.sums = [reduce_to_own_rows(total, param, view.rank, view.world_size)  # receives only those
                     for total, param in zip(self.sums, self.params)]
        squares = torch.cat([squared_norm(total) for total in self.sums]) if self.sums else None
        if squares is not None:
            dist.all_reduce(squares)
        self.sum_norms = [float(square) ** 0.5 for square in squares] if squares is not None else []
        reached = [k for k, shard in enumerate(self._shards) if shard in self.shard_reads]
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, reached)
        self.shard_reads = {self._shards[k] for each in everyone for k in each}


    def expected(self, k: int, view) -> tuple[Tensor, float]:
        """The k-th compared parameter's reference sum as this rank compares it (under sharding its rows) and the
        whole sum's norm."""
        if self.sum_norms is not None:  # summed over the ranks: this rank's rows already
            return self.sums[k], self.sum_norms[k]
        whole = self.sums[k]
        return (view.rows(whole, self.params[k]) if view is not None else whole), float(squared_norm(whole)) ** 0.5


def reference_dtype(param: Tensor) -> torch.dtype:
    """fp64 sums where the probe runs in fp64; at least fp32 otherwise (bf16 sums would lose the comparison)."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def _example_gradient(example_loss: Tensor, params: list[nn.Parameter], shards: list[Tensor] = (),
                      shard_reads: set | None = None) -> list[Tensor]:
    """One example's gradient of every compared parameter (zeros where it has none), from the retained graph.
    ``shards`` (FSDP2): the sharded parameters, which FSDP2 gathers outside autograd, so a gradient reaching one
    is a path around the layers (added to ``shard_reads``)."""
    row = torch.autograd.grad(example_loss, list(params) + list(shards), retain_graph=True, allow_unused=True)
    for g, shard in zip(row[len(params):], shards):
        if g is not None:
            shard_reads.add(shard)
    return [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(row[:len(params)], params)]


NORM_CHUNK = 1 << 16  # entries per partial dot product


def squared_norm(gradient: Tensor) -> Tensor:
    """‖g‖² as a (1,) fp64 tensor: the norms of rows of 65,536 entries in g's own precision, squared and summed in
    fp64. One fp32 reduction over a 65M-entry embedding gradient is off by ~1e-3 relative (the comparison's whole
    tolerance); converting g to fp64 first cost a quarter of the reference's time, and one dot product per chunk
    (a thousand kernel calls per embedding gradient) more than half of the whole probe's. A non-finite entry makes
    it non-finite, which the caller checks instead of scanning g again."""
    flat = gradient.reshape(-1)
    whole = flat.numel() - flat.numel() % NORM_CHUNK
    parts = [torch.linalg.vector_norm(flat[:whole].view(-1, NORM_CHUNK), dim=1)] if whole else []
    if whole < flat.numel():
        parts.append(torch.linalg.vector_norm(flat[whole:]).reshape(1))
    if not parts:
        return flat.new_zeros(1, dtype=torch.float64)
    return torch.cat(parts).double().pow(2).sum().reshape(1)


DIFFERENCE_BLOCK = 16 * NORM_CHUNK  # entries of a difference formed at once: never a model-sized temporary


def squared_distance(got: Tensor, expected: Tensor) -> Tensor:
    """‖got − expected‖² as a (1,) fp64 tensor, ``got`` taken in ``expected``'s precision, with the same
    partial sums as ``squared_norm``; the difference of a 32k × 2k tied embedding is formed a block at a time
    (a whole one was a 262 MB allocation, zero-filled page by page, for one read)."""
    a, b = got.reshape(-1), expected.reshape(-1)
    parts = [squared_norm(a[start:start + DIFFERENCE_BLOCK].to(b.dtype) - b[start:start + DIFFERENCE_BLOCK])
             for start in range(0, b.numel(), DIFFERENCE_BLOCK)]
    return torch.cat(parts).sum().reshape(1) if parts else b.new_zeros(1, dtype=torch.float64)


def reference_gradients(engine, batch, loss_fn, device, params, other_norms_sq=None, examples=None) -> Reference:
    """The reference for one probe batch (``Reference``); a failure of plain autograd is ``ReferenceFailed``.
    ``examples``: the examples whose gradients are taken (None: all); the others count with gradient 0.

    Under sharding the ranks share the examples (``shared_examples``): each takes its own examples' backward
    passes, and the norms and clipped sums are then summed over the ranks — each example counted on one rank —
    so every rank holds the whole reference, as if it had taken them all (a failure on any rank fails all)."""
    view = view_of(engine)
    if view is None or examples is None:
        return _reference(engine, batch, loss_fn, device, params, other_norms_sq, examples)
    failed = None
    try:
        reference = _reference(engine, batch, loss_fn, device, params, other_norms_sq, examples,
                               (view.rank, view.world_size))
    except Exception as error:  # noqa: BLE001 - any failure of this rank's share (not only ReferenceFailed: a
        failed = error          # ValueError of the model) is raised on every rank alike, after the others' passes
    raise_on_every_rank(engine.distributed, failed, engine.params[0].device)
    reference.add_over_ranks(engine)
    return reference


def shared_examples(examples: list[int], rank: int, world_size: int) -> tuple[set[int], int | None]:
    """This rank's share of the compared examples — the i-th to rank i mod N (``dealt``) — and, for a rank with
    one fewer than the others, an example it does not count whose backward pass it runs as well (each backward pass
    is a collective under FSDP2, so every rank runs as many)."""
    mine, passes = dealt(len(examples), rank, world_size)
    own = {examples[i] for i in mine}
    uncounted = next((e for e in examples if e not in own), None) if len(own) < passes else None
    return own, uncounted


def _reference(engine, batch, loss_fn, device, params, other_norms_sq, examples, share=None) -> Reference:
    try:
        return Reference(engine, batch, loss_fn, device, params, other_norms_sq, examples, share)
    except RuntimeError as error:
        if isinstance(error, ReferenceFailed):
            raise
        raise ReferenceFailed(type(error).__name__) from error
