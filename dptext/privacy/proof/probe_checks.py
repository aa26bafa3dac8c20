"""The checks of the start-up probe (``dptext.privacy.proof.verify``), one synthetic batch at a time (the reference
in ``reference``, the re-drawn examples in ``independence``).

``probe_one`` runs them in order: the plain loss (its shape, buffers left alone), the hooked forward with its
structural checks (in-place outputs, rows that are not examples, batch-1 expansions, parameters read outside
their module), the engine's norms and clipped sums, the reference (per-example autograd without the hooks, for
the compared parameters) against them, and the re-drawn examples (no other example's loss or recorded row may
move). A check that stops early still lets interacting examples and a failing reference speak first.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dptext.errors import UserError
from dptext.privacy.clipping import sums as clipping
from dptext.privacy.proof.buffers import BUFFER_CHANGED, buffer_snapshot, changed_buffer
from dptext.privacy.proof.independence import (_first_tensor, check_loss_independence, check_redrawn_examples,
                                               plain_loss, same_values)
from dptext.privacy.proof.hooked_forward import OUTSIDE_READ, engine_forward
from dptext.privacy.proof.reference import Reference, reference_gradients, squared_distance, squared_norm
from dptext.privacy.proof.sharded_probe import anywhere, planned, shard_of, view_of

RTOL = 1e-3  # the rules form norms in fp32; a missed path is off by far more
DIFFER = " differ from brute-force per-example autograd on the probe (a path or a layout its rule does not describe)"
ELSEWHERE = "a finding on another rank"  # what a rank that found nothing itself reports when another rank stopped


def _owners_of(engine, param) -> list[nn.Module]:
    return [m for m, (_, names) in engine.tracked.items() if any(planned(engine, m, n) is param for n in names)]


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
    view = view_of(engine)  # sharded: every rank takes every sum's collective, whatever its norms said
    for k, param in enumerate(params if not norm_failures or view is not None else []):
        expected_rows, expected_norm = reference.expected(k, view)
        error = sum_error(view, sums.get(param), expected_rows, param)
        if error is None or error > RTOL * expected_norm + 1e-6 * engine.max_grad_norm:
            sum_failures.append((param, "its clipped sums" + DIFFER))
    sum_failures = sum_failures if not norm_failures else []
    for param, what in norm_failures + sum_failures:
        for module in _owners_of(engine, param):
            report.refuse(module, what)
    for module in engine.tracked:
        if report.rows[module].status == "not reached" and any(
                float(whole[planned(engine, module, n)].max()) > floor for n in engine.tracked[module][1]
                if planned(engine, module, n) in whole):
            report.rows[module].status = "exact"


def sum_error(view, got: Tensor | None, expected: Tensor, param: Tensor) -> float | None:
    """‖engine's clipped sum − reference's‖ (None: not of the same shape). Sharded: the engine's sum is this
    rank's rows of world_size × the reference's (every rank ran the batch), compared with the same rows of the
    reference (``expected``: ``Reference.expected``), and the squared differences are summed over the ranks."""
    beyond = None  # the vocabulary cut (``proof.vocabulary``): the engine's rows beyond it, where the reference's
    if view is not None:  # are zero
        got = None if got is None else got / view.world_size
        if param in view.cut_rows and got is not None and got.shape[1:] == expected.shape[1:] \
                and len(expected) <= len(got):
            got, beyond = got[:len(expected)], squared_norm(got[len(expected):])
    shape_differs = got is not None and got.shape != expected.shape
    distance_sq = squared_norm(expected) if got is None or shape_differs else squared_distance(got, expected)
    if beyond is not None:
        distance_sq = distance_sq + beyond
    if view is not None:
        distance_sq = view.total(torch.cat([distance_sq, distance_sq.new_ones(1) * shape_differs]))
        shape_differs = bool(distance_sq[1] > 0)
    return None if shape_differs else float(distance_sq[0]) ** 0.5


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


def loss_shape_problem(batch: dict[str, Any], loss: Tensor) -> str | None:
    """Why the loss is not one entry per example of ``batch``, or None."""
    examples = batch["input_ids"].shape[0] if "input_ids" in batch else len(loss)
    if loss.ndim == 1 and len(loss) == examples:
        return None
    return (f"the loss has shape {tuple(loss.shape)} for {examples} examples; return one loss per example "
            "(dptext.privacy.per_example_loss)")


def compared_examples(batch: dict[str, Any], examples: int | None) -> set[int]:
    """The examples whose gradients the numeric comparison takes: the first (full length) and the one with the
    fewest real positions (the most padding). The batch keeps all its rows in every forward (the shapes B ≠ T and
    B = T are what the probe is about) and the redraws re-draw every example; the others' losses are weighted by 0
    in the engine's pass, so their exact gradient is 0 and any norm or sum the engine gives them is a path that
    moves gradient between examples. Two examples, not all: each example's brute-force gradient is one backward
    pass over the whole model, which made up half of the probe's time (docs/privacy_engine.md)."""
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    if examples is None:
        examples = len(next(v for v in batch.values() if isinstance(v, Tensor)))
    if not isinstance(mask, Tensor) or mask.ndim < 2 or len(mask) != examples:
        return set(range(min(examples, 2)))
    lengths = mask.reshape(examples, -1).sum(dim=1)
    return {0, int(torch.argmin(lengths[1:]).item()) + 1} if examples > 1 else {0}


def probe_one(engine, report, batch, loss_fn, device, redraw, decided_by) -> None:
    """One synthetic batch; ``redraw(j)`` gives it with example j re-drawn (None: one example, nothing to check).

    ``decided_by`` maps each tracked layer to the one whose numeric comparison decides for it
    (``proof.patterns.representatives``). The engine's pass runs before the
    reference, whose all-layer coefficients need the engine's norms of the layers not compared; a reference that
    fails itself still speaks first (nothing can be proven then), so a check that stops early runs it too."""
    compared = list(dict.fromkeys(planned(engine, module, name) for module, rep in decided_by.items() if rep is module
                                  for name in engine.tracked[module][1]))

    def stop(loss_checked: bool = True) -> None:
        """An early finding: interacting examples and a failing reference still speak first."""
        if redraw is not None and loss_checked and not anywhere(engine, bool(report.loss_problem)):
            baseline = plain_loss(engine, batch, loss_fn, device)  # the redraws' losses are computed this way
            check_loss_independence(engine, report, batch, redraw, loss_fn, device, baseline)
        reference_gradients(engine, batch, loss_fn, device, compared,  # raises ReferenceFailed if it fails
                            examples=compared_examples(batch, None))

    # The hooked forward is also the probe's training forward: buffers it changes and the loss's shape are checked
    # on it (a separate plain forward for them cost two of the probe's ~26 passes over the model).
    shards = shard_of(engine)
    before = buffer_snapshot(engine.model, shards)
    forward = engine_forward(engine, report, batch, loss_fn, device)  # under sharding every rank takes each early
    if anywhere(engine, forward is None):  # stop below if any rank does (``sharded_probe.anywhere``)
        engine.recorder.take_uses()
        return stop()
    loss, uses = forward
    changed = changed_buffer(engine.model, before, shards)
    if anywhere(engine, changed is not None):
        report.state_problem = BUFFER_CHANGED.format(changed or ELSEWHERE)
        engine.recorder.take_uses()
        return stop(loss_checked=False)
    shape_problem = loss_shape_problem(batch, loss)
    if anywhere(engine, bool(shape_problem)):  # never overwrite: an earlier shape's finding must stand
        report.loss_problem = report.loss_problem or shape_problem or ELSEWHERE
        engine.recorder.take_uses()
        return stop(loss_checked=False)
    if anywhere(engine, bool(report.refused() or report.loss_problem)):
        engine.recorder.take_uses()
        return stop()
    rows_before = [(use.module, _first_tensor(use.activation)) for use in uses]
    engine.probe_compared = set(compared)  # the other layers' clipped sums are not formed (none is compared)
    chosen = compared_examples(batch, len(loss))
    weights = torch.zeros(len(loss), dtype=loss.dtype, device=loss.device)
    weights[sorted(chosen)] = 1
    try:
        engine.accumulate(loss * weights)
    except UserError:  # e.g. non-finite norms: if plain autograd fails too, that is the finding (and the
        stop()         # fp64 probe retries in the model's own dtype)
        raise
    finally:
        engine.probe_compared = None
    norms_sq, sums = engine.last_norms_sq, engine.clipped_grads()
    engine.zero_grad()
    compared_set = set(compared)
    rest = {p: n for p, n in (norms_sq or {}).items() if p not in compared_set}
    reference = reference_gradients(engine, batch, loss_fn, device, compared, rest, chosen)
    if not same_values(loss.detach(), reference.loss):
        for module, _, _ in engine.recorder.expansions:
            report.refuse(module, "broadcasting its batch-1 input to the batch changes the model's output")
    for param in reference.shard_reads:  # FSDP2: a path through a shard, around every layer
        for module in _owners_of(engine, param):
            name = next(n for n in engine.tracked[module][1] if planned(engine, module, n) is param)
            report.refuse(module, OUTSIDE_READ.format(name))
    if anywhere(engine, bool(report.refused())):
        return stop()
    compare(engine, report, reference, norms_sq, sums)
    share_verdicts(engine, report, decided_by)
    if redraw is not None:
        check_redrawn_examples(engine, report, redraw, loss_fn, device, loss.detach(), rows_before)
