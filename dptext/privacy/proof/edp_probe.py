"""The start-up probe of eDP-SGD (``EDPEngine.verify``; ``privacy.verify`` in ``finetune``): its per-slot clipping
against brute-force autograd on synthetic inputs (random ids or the task's ``probe_batch``: no private data).

eDP-SGD clips a *slot* (micro-batch), not an example: Δ_m, the mean gradient of the examples in slot m, comes from
plain autograd over the whole model, is scaled by 1/α_l, clipped to C as one vector and summed. No per-example rule
is involved, so the DP-SGD probe's layer checks (in-place outputs, rows that are not examples, reads outside a
module) have nothing to check: autograd follows every path. What the probe does verify, for B ≠ T and B = T:
1. *The loss*: one entry per example (a 1-D tensor of B entries).
2. *The clipped sums*: the batch split into two slots, each slot's Δ_m by its own ``torch.autograd.grad`` (never
   through ``.grad``), scaled by the engine's α, clipped and summed, against what ``accumulate``/``close_unit``
   accumulate — so a hook that rewrites ``.grad`` after accumulation, or a gradient the engine does not collect,
   does not go unnoticed.
3. *Slots do not share state*: a training forward must not change any buffer of the model (BatchNorm's running
   statistics): a buffer carries one slot's data into the next and is released with the model without noise.
Not checked, and why: the independence of examples *within* a slot (the slot is the clipping unit, so examples in
it may interact); the slot assignment (a keyed hash of the record id, fixed before training and tested in
tests/test_edp.py: it depends on no other record); α measured on the first private examples (``first_step``),
which the mechanism already labels as not covered by (ε, δ).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dptext.errors import UserError
from dptext.privacy.clipping.sums import STABILITY
from dptext.privacy.proof.buffers import BUFFER_CHANGED, buffer_snapshot, changed_buffer
from dptext.privacy.proof.reference import same_randomness
from dptext.privacy.proof.probe_model import probe_precision
from dptext.privacy.proof.synthetic import output_functional_loss, synthetic_token_batch
from dptext.privacy.proof.verify import PROBE_SHAPES

RTOL = 1e-4  # the engine clips in fp32; a rewritten or uncollected gradient is off by far more


def _rows(batch: dict, rows: Tensor) -> dict:
    return {k: v[rows] if isinstance(v, Tensor) and v.ndim else v for k, v in batch.items()}


def reference_slot_grads(engine, slots: list[dict], loss_fn, device) -> list[dict[nn.Parameter, Tensor]]:
    """Each slot's gradient of its summed loss by its own ``torch.autograd.grad`` call (never through ``.grad``)."""
    result = []
    for slot in slots:
        with same_randomness(device):
            loss = loss_fn(engine.model, slot)
        grads = torch.autograd.grad(loss.float().sum(), engine.params, allow_unused=True)
        result.append({p: (torch.zeros_like(p) if g is None else g.detach()).double()
                       for p, g in zip(engine.params, grads)})
    return result


def clipped_slot_sum(engine, slot_grads: list[dict[nn.Parameter, Tensor]], sizes: list[int]) -> dict:
    """Σ_m clip(Δ_m / α), Δ_m = slot m's gradient / its size (what ``close_unit`` computes)."""
    totals: dict[nn.Parameter, Tensor] = {}
    for grads, size in zip(slot_grads, sizes):
        scaled = {p: g / size / (engine.alphas[p] if engine.alphas is not None else 1.0) for p, g in grads.items()}
        norm = torch.sqrt(sum(g.pow(2).sum() for g in scaled.values()))
        coef = float((engine.max_grad_norm / (norm + STABILITY)).clamp(max=1.0))
        for param, grad in scaled.items():
            totals[param] = totals.get(param, 0) + coef * grad
    return totals


def engine_slot_grads(engine, slots: list[dict], loss_fn, device):
    """What the engine collects for each slot (``.grad`` after ``accumulate``) and its clipped sum."""
    engine.zero_grad()
    collected = []
    for slot in slots:
        with same_randomness(device):
            engine.accumulate(loss_fn(engine.model, slot))
        collected.append({p: p.grad.detach().double().clone() for p in engine.params if p.grad is not None})
        engine.close_unit()
    sums = engine.clipped_grads()
    engine.zero_grad()
    return collected, sums


def first_difference(got: dict, expected: dict, floor: float) -> nn.Parameter | None:
    for param, value in expected.items():
        error = float((got.get(param, torch.zeros_like(value)).double() - value).norm())
        if error > RTOL * float(value.norm()) + floor:
            return param
    return None


def probe_edp(engine, make_batch=None, loss_fn=None, shapes=PROBE_SHAPES, dtype=torch.float64) -> None:
    """Run the checks of the module docstring; the first failure raises one sentence naming what failed."""
    model = engine.model
    make_batch = make_batch or synthetic_token_batch(model)
    loss_fn = loss_fn or output_functional_loss
    device = engine.params[0].device
    names = {param: name for name, param in model.named_parameters()}
    with probe_precision(model, dtype if device.type != "mps" else None):
        for number, (examples, positions) in enumerate(shapes):
            batch = {k: v.to(device) if isinstance(v, Tensor) else v
                     for k, v in make_batch(examples, positions, torch.Generator().manual_seed(number)).items()}
            before = buffer_snapshot(model)
            with torch.no_grad(), same_randomness(device):
                loss = loss_fn(model, batch)
            if loss.ndim != 1 or len(loss) != examples:
                raise UserError(f"The start-up probe refused the loss: it has shape {tuple(loss.shape)} for {examples} "
                                "examples; return one loss per example (dptext.privacy.per_example_loss).")
            changed = changed_buffer(model, before)
            if changed is not None:  # it would also carry one slot's data into the next
                raise UserError(f"The start-up probe refused {BUFFER_CHANGED.format(changed)}.")
            half = torch.arange(examples, device=device) < (examples + 1) // 2
            slots = [_rows(batch, half.nonzero().flatten()), _rows(batch, (~half).nonzero().flatten())]
            reference = reference_slot_grads(engine, slots, loss_fn, device)
            collected, sums = engine_slot_grads(engine, slots, loss_fn, device)
            # gradients first: one wrong gradient changes the slot's clip factor, so every sum would differ
            wrong = None
            for got, want in zip(collected, reference):
                wrong = first_difference(got, want, 1e-12) if wrong is None else wrong
            if wrong is None:
                sizes = [int(half.sum()), int((~half).sum())]
                wrong = first_difference(sums, clipped_slot_sum(engine, reference, sizes), 1e-7 * engine.max_grad_norm)
            if wrong is not None:
                raise UserError(f"The start-up probe refused parameter '{names.get(wrong, '?')}': eDP-SGD's "
                                "clipped slot sums differ from brute-force autograd on the probe (a hook that "
                                "rewrites its .grad, or a gradient the engine does not collect); remove the "
                                "hook or freeze the parameter.")
    engine.zero_grad()
