"""Examples must not interact: re-drawing one example may move no other example's loss nor any other row of a
recorded layer input (the loss is per example, and rows are examples). Checked on the plain model where the probe
stops early, and with the engine's hooks otherwise.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

from dptext.privacy.proof.reference import ReferenceFailed, same_randomness
from dptext.privacy.proof.sharded_probe import anywhere, dealt, raise_on_every_rank, view_of


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
        if anywhere(engine, other.shape != loss.shape or not same_values(other[keep], loss[keep])):
            report.loss_problem = LOSSES_INTERACT
            return


def check_redrawn_examples(engine, report, redraw, loss_fn, device, loss, rows_before) -> None:
    """Re-draw each example's tokens in turn, with the hooks: every other example's loss and every other row of
    every recorded input must stay put (the loss is per example, and rows are examples). One hooked pass per
    example checks both; ``loss`` and ``rows_before`` come from the hooked pass of the unchanged batch, so all
    the values compared are computed the same way (see ``check_loss_independence``). Under sharding the ranks
    share the re-draws (``redraws_of_this_rank``) and every rank refuses the layers any rank saw move."""
    engine.recorder.take_uses()
    engine.recorder.probing = True
    before = _by_occurrence(rows_before)
    view = view_of(engine)
    rank, world_size = (view.rank, view.world_size) if view is not None else (0, 1)
    moved: dict = {}  # (ordered: the refusals in the order found)
    ranks = engine.distributed if view is not None else None
    for example in redraws_of_this_rank(len(loss), rank, world_size):
        other, after = _shared_pass(engine, ranks, redraw(example), loss_fn, device)
        keep = others(loss, example)
        if anywhere(engine, other.shape != loss.shape or not same_values(other[keep], loss[keep])):
            report.loss_problem = LOSSES_INTERACT
            break  # (every rank stops at the same pass: the stop is decided over all ranks)
        moved.update(dict.fromkeys(_moved_rows(before, after, keep, len(loss), same_values)))
    for module in moved_anywhere(engine, moved):
        report.refuse(module, ROWS_INTERACT)


def redraws_of_this_rank(examples: int, rank: int, world_size: int) -> list[int]:
    """The examples one rank re-draws: every one in one process. Under sharding each re-drawn pass runs on one
    rank only — rank r takes r, r + N, … — so the probe's passes fall with the ranks as a step's share of the batch
    does (on N ranks a step's per-rank batch is 1/N of the whole, the probe's is not). Every pass is a collective,
    so every rank runs as many passes: one with none left re-draws its first example again. The batch itself, and
    so the values every re-draw is compared with, is the same on every rank (``check_same_batch``)."""
    mine, passes = dealt(examples, rank, max(world_size, 1))
    mine = (mine or [rank % examples]) if examples else []
    return [mine[i] if i < len(mine) else mine[0] for i in range(passes)]


def moved_anywhere(engine, moved: dict) -> list:
    """The layers whose rows moved: on this rank, or under sharding on any rank (in the engine's order), so that
    every rank refuses the same layers (the ranks' reports are compared at the end)."""
    if view_of(engine) is None:
        return list(moved)
    names = [engine.names[module] for module in engine.tracked if module in moved]
    everyone: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, names)
    anywhere_moved = {name for each in everyone for name in each}
    return [module for module in engine.tracked if engine.names[module] in anywhere_moved]


def _by_occurrence(rows) -> dict[tuple, Tensor | None]:
    """{(module, k): its k-th recorded input} from (module, input) pairs in call order."""
    seen: dict[Any, int] = {}
    out = {}
    for module, value in rows:
        seen[module] = seen.get(module, -1) + 1
        out[(module, seen[module])] = value
    return out


def _first_tensor(activation: Any) -> Tensor | None:
    value = activation[0] if isinstance(activation, tuple) else activation
    return value if isinstance(value, Tensor) else None


def plain_loss(engine, batch, loss_fn, device) -> Tensor:
    """The loss without the engine's hooks or autograd; a failure of the model's own forward is ReferenceFailed."""
    try:
        with torch.no_grad(), engine.recorder.paused(), same_randomness(device):
            return loss_fn(engine.model, batch)
    except RuntimeError as error:
        raise ReferenceFailed(type(error).__name__) from error


IN_TRAINING_PRECISION = "in the precision training runs in ({}), " + LOSSES_INTERACT
ROWS_IN_TRAINING_PRECISION = "in the precision training runs in ({}), " + ROWS_INTERACT


def check_training_precision(engine, report, batch, redraw, loss_fn, autocast_dtype, computes_in) -> None:
    """Examples must not interact in the precision training computes in either: the probe's comparisons run in
    fp64 (or fp32 on a sharded or large model), so a forward that branches on its weights' dtype or on autocast
    would be proven on a path training never takes (session-26 red teams: every row replaced by example 0's in bf16
    only; then mixes only with gradients on, or only among the middle examples). So the re-draws run once more as
    training's forward does — under ``autocast_dtype``'s autocast (None: none; an FSDP2 policy gathers in bf16 by
    itself), with autograd and the engine's hooks on — every example in turn: no other example's loss nor any other
    row of a recorded layer input may move. Same shapes, kernels and dropout masks, so untouched rows agree to
    rounding (in half precision to 1 %: bf16 keeps 8 bits; a mix moves them by far more). ``computes_in``: the
    dtype the forward computes in. What this cannot see is a coupling of examples in the backward pass only, with
    an unchanged forward."""
    device = engine.params[0].device
    close = _close_in_half if computes_in in (torch.bfloat16, torch.float16) else same_values
    engine.recorder.take_uses()
    engine.recorder.probing = True
    try:
        with torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else nullcontext(), \
                torch.enable_grad():
            loss, rows = _hooked_pass(engine, batch, loss_fn, device)
            ranks = engine.distributed if engine.distributed is not None and engine.distributed.active else None
            for example in redraws_of_this_rank(len(loss), ranks.rank, ranks.world_size) if ranks is not None \
                    else range(len(loss)):  # (the ranks share the re-draws, as ``check_redrawn_examples``)
                other, other_rows = _shared_pass(engine, ranks, redraw(example), loss_fn, device)
                keep = others(loss, example)
                loss_moved = other.shape != loss.shape or not close(other[keep], loss[keep])
                rows_moved = bool(_moved_rows(rows, other_rows, keep, len(loss), close))
                if ranks is not None:  # every rank names the same finding
                    loss_moved, rows_moved = ranks.any_rank(loss_moved, device), ranks.any_rank(rows_moved, device)
                if loss_moved or rows_moved:
                    report.loss_problem = (IN_TRAINING_PRECISION if loss_moved else ROWS_IN_TRAINING_PRECISION) \
                        .format(str(computes_in).removeprefix("torch."))
                    return
    except RuntimeError as error:  # the model's own forward fails in that precision: nothing is proven there
        raise ReferenceFailed(type(error).__name__) from error
    finally:
        engine.recorder.take_uses()
        engine.recorder.probing = False


def _hooked_pass(engine, batch, loss_fn, device) -> tuple[Tensor, dict]:
    """A forward on ``batch`` with the engine's hooks recording (the probe's dropout masks): its per-example loss
    and each layer's k-th recorded input; the uses are dropped (no backward)."""
    with same_randomness(device):
        loss = loss_fn(engine.model, batch).detach()
    rows = _by_occurrence((use.module, _first_tensor(use.activation)) for use in engine.recorder.uses)
    engine.recorder.take_uses()
    return loss, rows


def _shared_pass(engine, ranks, batch, loss_fn, device) -> tuple[Tensor, dict]:
    """``_hooked_pass`` of one rank's re-draw: the ranks re-draw different examples, so a forward that fails on
    one re-drawn batch fails on one rank only; it is raised on every rank (``raise_on_every_rank``) before the
    next collective, as it was where every rank ran every re-draw. ``ranks``: None in one process."""
    failed = result = None
    try:
        result = _hooked_pass(engine, batch, loss_fn, device)
    except Exception as error:  # noqa: BLE001 - whatever the model raises, every rank raises it
        failed = error
    raise_on_every_rank(ranks, failed, device)
    return result


def _close_in_half(a: Tensor, b: Tensor) -> bool:
    scale = float(a.detach().abs().max()) if a.numel() else 0.0
    return bool(torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3 * scale + 1e-6))


def _moved_rows(before: dict, after: dict, keep: Tensor, examples: int, close) -> list:
    """The layers whose k-th recorded input moved in a ``keep`` row between ``before`` and ``after`` (matched by
    occurrence, not position: a redraw that changes which layers run must not shift them)."""
    return [key[0] for key, a in before.items()
            if a is not None and (b := after.get(key)) is not None and a.shape == b.shape and len(a) == examples
            and not close(a[keep], b[keep])]
