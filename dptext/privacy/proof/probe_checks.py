"""The checks of the start-up probe (``dptext.privacy.proof.verify``), one synthetic batch at a time.

``probe_one`` runs them in order: the plain loss (its shape, buffers left alone), the hooked forward with its
structural checks (in-place outputs, rows that are not examples, batch-1 expansions, parameters read outside
their module), the engine's norms and clipped sums, the reference (per-example autograd without the hooks, for
the compared parameters) against them, and the re-drawn examples (no other example's loss or recorded row may
move). A check that stops early still lets interacting examples and a failing reference speak first.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from dptext.errors import UserError
from dptext.privacy.clipping import sums as clipping

RTOL = 1e-3  # the rules form norms in fp32; a missed path is off by far more
DIFFER = " differ from brute-force per-example autograd on the probe (a path or a layout its rule does not describe)"
METADATA = {"__get__", "size", "dim", "numel", "is_floating_point", "data_ptr", "stride", "is_contiguous",
            "element_size", "__len__", "__format__", "__repr__", "__hash__", "__eq__"}


class ParameterReads(TorchFunctionMode):
    """Records tracked parameters read by a torch function outside every module that owns them."""

    def __init__(self, owners: dict[int, set[nn.Module]]):
        super().__init__()
        self.owners, self.stack, self.outside = owners, [], set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in METADATA:
            for value in list(args) + list(kwargs.values()):
                for item in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(item, Tensor) and id(item) in self.owners:
                        if not self.stack or self.stack[-1] not in self.owners[id(item)]:
                            self.outside.add(id(item))
        return func(*args, **kwargs)


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

    ``params`` are the parameters compared (those of one representative layer per use pattern,
    ``dptext.privacy.proof.patterns``); ``other_norms_sq`` the engine's per-example squared norms of the rest,
    which complete each example's whole-model norm in the all-layer layout (they come from the same rules on the
    same code paths as the representatives', whose norms are compared here). A coefficient needs only its own
    example's norms, so each example's gradient is folded into the sums as soon as it is taken and dropped:
    holding all of them (B model-sized fp64 copies) made the probe's peak 14.8 fp32 model sizes on a random
    36M-parameter Llama, 9.2 without (``benchmarks/probe_memory.py``)."""

    def __init__(self, engine, batch, loss_fn, device, params: list[nn.Parameter],
                 other_norms_sq: dict[nn.Parameter, Tensor] | None = None):
        params = list(params)
        others = other_norms_sq or {}
        squares: list[dict[nn.Parameter, Tensor]] = []
        self.params = params
        self.sums = [torch.zeros_like(p, dtype=reference_dtype(p)) for p in params]
        with requiring_grad(params):
            with engine.recorder.paused(), same_randomness(device):
                loss = loss_fn(engine.model, batch)
            self.loss = loss.detach()
            for i in range(len(loss) if loss.ndim == 1 else 0):
                row = _example_gradient(loss[i], params)
                norms = {p: squared_norm(g) for g, p in zip(row, params)}
                if not all(bool(torch.isfinite(n)) for n in norms.values()):
                    raise ReferenceFailed("non-finite losses or gradients")
                whole = {**norms, **{p: n[i:i + 1].double() for p, n in others.items() if p not in norms}}
                coef, _ = clipping.clip_coefficients(whole, engine.max_grad_norm, engine.clipping_layout,
                                                     len(engine.params))
                for total, g, p in zip(self.sums, row, params):
                    total.add_(g.to(total.dtype), alpha=float(coef[p]))
                squares.append(norms)
        self.norms_sq = {p: torch.cat([each[p] for each in squares]) if squares else None for p in params}
        if not bool(torch.isfinite(self.loss).all()):
            raise ReferenceFailed("non-finite losses or gradients")


def reference_dtype(param: Tensor) -> torch.dtype:
    """fp64 sums where the probe runs in fp64; at least fp32 otherwise (bf16 sums would lose the comparison)."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def _example_gradient(example_loss: Tensor, params: list[nn.Parameter]) -> list[Tensor]:
    """One example's gradient of every compared parameter (zeros where it has none), from the retained graph."""
    row = torch.autograd.grad(example_loss, params, retain_graph=True, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(row, params)]


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


def reference_gradients(engine, batch, loss_fn, device, params, other_norms_sq=None) -> Reference:
    """The reference for one probe batch (``Reference``); a failure of plain autograd is ``ReferenceFailed``."""
    try:
        return Reference(engine, batch, loss_fn, device, params, other_norms_sq)
    except RuntimeError as error:
        if isinstance(error, ReferenceFailed):
            raise
        raise ReferenceFailed(type(error).__name__) from error


def engine_forward(engine, report, batch, loss_fn, device):
    """The loss with the engine's hooks and the outside-read detector; returns (loss, uses) or None if refused."""
    recorder = engine.recorder
    owners: dict[int, set[nn.Module]] = {}
    for module, (_, names) in engine.tracked.items():
        for name in names:
            owners.setdefault(id(module.get_parameter(name)), set()).add(module)
    reads = ParameterReads(owners)
    def enter(module, args) -> None:
        reads.stack.append(module)

    def leave(module, args, output) -> None:  # returns None: a hook's return value would replace the output
        reads.stack.pop()

    handles = []
    for module in engine.tracked:
        handles.append(module.register_forward_pre_hook(enter, prepend=True))
        handles.append(module.register_forward_hook(leave))
    recorder.probing = True
    try:
        with same_randomness(device), reads:
            loss = loss_fn(engine.model, batch)
    except Exception as error:  # noqa: BLE001 - a crash only with the hooks is the expansion's fault
        expanded = {module for module, _, _ in recorder.expansions}
        recorder.take_uses()
        if not expanded:
            raise
        for module in expanded:
            report.refuse(module, f"broadcasting its batch-1 input to the batch breaks the model's forward "
                                  f"({type(error).__name__})")
        return None
    finally:
        for handle in handles:
            handle.remove()
    for module, args, output in recorder.expansions:
        with torch.no_grad(), recorder.paused():
            alone = module(*args)
        if output is None or not _broadcasts_to(alone, output):
            report.refuse(module, "broadcasting its batch-1 input to the batch changes its output")
    for module, (_, names) in engine.tracked.items():
        for name in names:
            if id(module.get_parameter(name)) in reads.outside:
                report.refuse(module, f"its parameter '{name}' is also read outside the module (a functional use "
                                      "or a second module), a path its rule does not see")
    uses = list(recorder.uses)
    for use in uses:
        problem = use.problem or use.in_place_problem()
        if problem:
            report.refuse(use.module, problem)
    return loss, uses


def _broadcasts_to(alone: Any, output: Tensor) -> bool:
    if not isinstance(alone, Tensor):
        return False
    try:
        return bool(torch.allclose(alone.expand_as(output), output.detach()))
    except RuntimeError:
        return False


def _owners_of(engine, param) -> list[nn.Module]:
    return [m for m, (_, names) in engine.tracked.items() if any(m.get_parameter(n) is param for n in names)]


def compare(engine, report, reference: Reference, norms_sq, sums) -> None:
    """Per compared parameter: engine norms and clipped sums against the reference's, clipped with the same C."""
    params = reference.params
    ref_norms = reference.norms_sq
    whole = {**{p: n.double() for p, n in (norms_sq or {}).items()}, **ref_norms}
    _, totals = clipping.clip_coefficients(whole, engine.max_grad_norm, engine.clipping_layout, len(engine.params))
    floor = 1e-8 * float(totals.max()) ** 2 + 1e-30
    # Norms first: one wrong norm changes every coefficient in the all-layer layout, so the clipped sums of
    # innocent layers would differ too; the norm points at the layer to blame.
    norm_failures = []
    for param in params:
        got = norms_sq.get(param) if norms_sq is not None else None
        if got is None:
            if norms_sq is not None and float(ref_norms[param].max()) > floor:
                norm_failures.append((param, "the engine recorded no gradient for it but brute-force autograd "
                                              "finds one (a path its hooks do not see)"))
        elif bool(((got.double() - ref_norms[param]).abs() > RTOL * ref_norms[param] + floor).any()):
            norm_failures.append((param, "its per-example gradient norms" + DIFFER))
    sum_failures = []
    for param, expected_sum in zip(params if not norm_failures else [], reference.sums):
        got_sum = sums.get(param, torch.zeros_like(expected_sum)).to(expected_sum.dtype)
        error = float(squared_norm(got_sum - expected_sum)) ** 0.5
        if error > RTOL * float(squared_norm(expected_sum)) ** 0.5 + 1e-6 * engine.max_grad_norm:
            sum_failures.append((param, "its clipped sums" + DIFFER))
    for param, what in norm_failures + sum_failures:
        for module in _owners_of(engine, param):
            report.refuse(module, what)
    for module in engine.tracked:
        if report.rows[module].status == "not reached" and any(
                float(whole[module.get_parameter(n)].max()) > floor for n in engine.tracked[module][1]
                if module.get_parameter(n) in whole):
            report.rows[module].status = "exact"


def share_verdicts(engine, report, decided_by: dict[nn.Module, nn.Module]) -> None:
    """Layers not compared themselves take the verdict of their pattern's representative (``proof.patterns``)."""
    for module, representative in decided_by.items():
        if representative is module:
            continue
        row, decider = report.rows[module], report.rows[representative]
        if decider.status == "refused":
            report.refuse(module, f"{decider.why} (found on '{decider.name}', whose use pattern it shares)")
        elif decider.status == "not reached" and row.status == "exact":
            row.status = "not reached"  # reached here only: its representative's comparison says nothing of it
            report.refuse(module, "the probe compared no layer of its use pattern with brute force (its "
                                  f"representative '{decider.name}' received no gradient)")


def with_row(batch: dict[str, Any], fresh: dict[str, Any], example: int) -> dict[str, Any]:
    """``batch`` with ``example``'s row of every per-example tensor (first dimension = the examples) taken from
    ``fresh``, another synthetic batch of the same shape: tokens, lengths and labels of that example re-drawn."""
    examples = next(iter(v for v in batch.values() if isinstance(v, Tensor))).shape[0]
    out = dict(batch)
    for key, value in batch.items():
        other = fresh.get(key)
        if isinstance(value, Tensor) and isinstance(other, Tensor) and value.ndim and value.shape[0] == examples \
                and other.shape == value.shape:
            out[key] = value.clone()
            out[key][example] = other[example]
    return out


def same_values(a: Tensor, b: Tensor) -> bool:
    """Equal up to rounding: the probe recomputes the same rows with the same kernels, so they agree to the last
    bits in fp64 (1e-9) and to a few ulps in fp32 (the probe of a large model runs in its own precision; examples
    that interact move each other by far more)."""
    tight = a.dtype == torch.float64 and b.dtype == torch.float64
    return bool(torch.allclose(a.double(), b.double(), rtol=1e-9 if tight else 1e-5, atol=1e-12 if tight else 1e-6))


def others(loss: Tensor, example: int) -> Tensor:
    return torch.arange(len(loss), device=loss.device) != example


LOSSES_INTERACT = ("changing one example changed another example's loss, so examples interact (in-batch "
                   "negatives, batch statistics, a batch-averaged loss, routing by score across the batch); such a "
                   "loss needs another privacy unit")
ROWS_INTERACT = ("changing one example changed other rows of its input, so its rows are not one example each "
                 "(sequence-first layout, experts fed gathered tokens)")


def check_loss_independence(engine, report, batch, redraw, loss_fn, device, loss: Tensor) -> None:
    """Re-draw each example's tokens in turn: every other example's loss must stay put (checked without the
    hooks). Every example, not one: a router that picks tokens by score lets only some examples move others.

    Used where the probe stops early, so that interacting examples are named before a layer the engine refused.
    The losses compared are all computed the same way (no autograd, hooks paused): the reference pass differs in
    the last bits wherever a kernel takes another path when its weights require gradients (seen on Longformer in
    fp32), and that must not read as examples interacting, nor widen the tolerance that catches real ones."""
    for example in range(len(loss)):
        other, keep = plain_loss(engine, redraw(example), loss_fn, device), others(loss, example)
        if other.shape != loss.shape or not same_values(other[keep], loss[keep]):
            report.loss_problem = LOSSES_INTERACT
            return


def check_redrawn_examples(engine, report, redraw, loss_fn, device, loss, rows_before) -> None:
    """Re-draw each example's tokens in turn, with the hooks: every other example's loss and every other row of
    every recorded input must stay put (the loss is per example, and rows are examples). One hooked pass per
    example checks both; ``loss`` and ``rows_before`` come from the hooked pass of the unchanged batch, so all
    the values compared are computed the same way (see ``check_loss_independence``)."""
    engine.recorder.take_uses()
    engine.recorder.probing = True
    for example in range(len(loss)):
        with same_randomness(device):
            other = loss_fn(engine.model, redraw(example)).detach()
        changed_uses = list(engine.recorder.uses)
        engine.recorder.take_uses()
        keep = others(loss, example)
        if other.shape != loss.shape or not same_values(other[keep], loss[keep]):
            report.loss_problem = LOSSES_INTERACT
            return
        for (module, a), second in zip(rows_before, changed_uses):
            b = _first_tensor(second.activation)
            if module is not second.module or a is None or b is None or a.shape != b.shape or len(a) != len(loss):
                continue
            if not same_values(a[keep], b[keep]):
                report.refuse(module, ROWS_INTERACT)


def _first_tensor(activation: Any) -> Tensor | None:
    value = activation[0] if isinstance(activation, tuple) else activation
    return value if isinstance(value, Tensor) else None


def buffer_snapshot(model: nn.Module) -> dict[str, Tensor]:
    return {name: buffer.detach().clone() for name, buffer in model.named_buffers()}


def changed_buffer(model: nn.Module, before: dict[str, Tensor]) -> str | None:
    """The first buffer a training forward changed since ``before`` (running statistics), else None."""
    for name, value in model.named_buffers():
        if name not in before or value.shape != before[name].shape or not torch.equal(value, before[name]):
            return name
    return None


BUFFER_CHANGED = ("buffer '{}': a training forward changes it (running statistics), so it is computed from the "
                  "private batches and released with the model without noise; put that layer in eval mode or "
                  "remove it")


def plain_loss(engine, batch, loss_fn, device) -> Tensor:
    """The loss without the engine's hooks or autograd; a failure of the model's own forward is ReferenceFailed."""
    try:
        with torch.no_grad(), engine.recorder.paused(), same_randomness(device):
            return loss_fn(engine.model, batch)
    except RuntimeError as error:
        raise ReferenceFailed(type(error).__name__) from error


def probe_one(engine, report, batch, loss_fn, device, redraw, decided_by) -> None:
    """One synthetic batch; ``redraw(j)`` gives it with example j re-drawn (None: one example, nothing to check).

    ``decided_by`` maps each tracked layer to the one whose numeric comparison decides for it
    (``proof.patterns.representatives``). The engine's pass runs before the
    reference, whose all-layer coefficients need the engine's norms of the layers not compared; a reference that
    fails itself still speaks first (nothing can be proven then), so a check that stops early runs it too."""
    compared = list(dict.fromkeys(module.get_parameter(name) for module, rep in decided_by.items() if rep is module
                                  for name in engine.tracked[module][1]))

    def stop(loss_checked: bool = True) -> None:
        """An early finding: interacting examples and a failing reference still speak first."""
        if redraw is not None and loss_checked and not report.loss_problem:
            check_loss_independence(engine, report, batch, redraw, loss_fn, device, loss_plain)
        reference_gradients(engine, batch, loss_fn, device, compared)  # raises ReferenceFailed if it fails

    before = buffer_snapshot(engine.model)
    loss_plain = plain_loss(engine, batch, loss_fn, device)
    changed = changed_buffer(engine.model, before)
    if changed is not None:
        report.state_problem = BUFFER_CHANGED.format(changed)
        return stop(loss_checked=False)
    examples = batch["input_ids"].shape[0] if "input_ids" in batch else len(loss_plain)
    if loss_plain.ndim != 1 or len(loss_plain) != examples:
        report.loss_problem = (f"the loss has shape {tuple(loss_plain.shape)} for {examples} examples; return one "
                               "loss per example (dptext.privacy.per_example_loss)")
        return stop(loss_checked=False)
    forward = engine_forward(engine, report, batch, loss_fn, device)
    if forward is None:
        return stop()
    loss, uses = forward
    if report.refused() or report.loss_problem:
        engine.recorder.take_uses()
        return stop()
    rows_before = [(use.module, _first_tensor(use.activation)) for use in uses]
    engine.probe_compared = set(compared)  # the other layers' clipped sums are not formed (none is compared)
    try:
        engine.accumulate(loss)
    except UserError:  # e.g. non-finite norms: if plain autograd fails too, that is the finding (and the
        stop()         # fp64 probe retries in the model's own dtype)
        raise
    finally:
        engine.probe_compared = None
    norms_sq, sums = engine.last_norms_sq, engine.clipped_grads()
    engine.zero_grad()
    compared_set = set(compared)
    rest = {p: n for p, n in (norms_sq or {}).items() if p not in compared_set}
    reference = reference_gradients(engine, batch, loss_fn, device, compared, rest)
    if not same_values(loss.detach(), reference.loss):
        for module, _, _ in engine.recorder.expansions:
            report.refuse(module, "broadcasting its batch-1 input to the batch changes the model's output")
    if report.refused():
        return stop()
    compare(engine, report, reference, norms_sq, sums)
    share_verdicts(engine, report, decided_by)
    if redraw is not None:
        check_redrawn_examples(engine, report, redraw, loss_fn, device, loss.detach(), rows_before)
