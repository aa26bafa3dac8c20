"""The start-up verification probe: the engine against brute-force per-example autograd on synthetic inputs.

Nothing here touches private data: the probe feeds random token ids within the vocabulary (unequal lengths,
right padding) — or a task's own synthetic batch (``task.probe_batch``) with the task's loss — so it costs no
privacy. A ``PrivacyEngine`` runs it before the model's first training forward unless built with
``verify=False``. For each probe shape (B ≠ T, then B = T) it
1. runs the model without the hooks and without autograd: the loss must have one entry per example, and that
   training forward must change no buffer of the model (running statistics would be released without noise);
2. runs the same forward with the hooks (same dropout masks) and checks, per layer, what would make the rules
   wrong: an output modified in place, rows that are not one example each, a broadcast of a batch-1 input that
   changes the forward, a tracked weight read outside its module (a functional use or a second module);
3. lets the engine produce its per-parameter norms and clipped sums, then takes each example's gradient of the
   *compared* parameters by its own autograd pass (one representative layer per use pattern, ``proof.patterns``;
   fp64 for models up to ``FP64_PARAMETERS``, the model's own precision above) and compares norms and clipped
   sums (``reference.Reference``); the other layers of a pattern share the representative's verdict;
4. re-draws one example at a time (its row of every tensor of the batch) with the hooks: every other example's
   loss and every other row of every recorded input must stay put (the loss is per example, rows are examples).
5. where training computes in another precision than these comparisons (bf16 autocast or an FSDP2 bf16 policy;
   fp32 against the fp64 probe), re-draws every example once more in that precision, with the hooks and autograd
   on as in training: no other example's loss nor row may move (``independence.check_training_precision``).
Any finding names the layer; ``ProbeReport.raise_if_refused`` turns the first into one sentence. The first shape
runs on the whole model; the second on each block stack cut after its last block that differs (``proof.stack``)
and, with the default batch, on the first rows of the vocabulary (``proof.vocabulary``). On an FSDP2-sharded model
every rank runs it together (``proof.sharded_probe``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from dptext.allocator import release_freed_memory
from dptext.errors import UserError
from dptext.models.modes import ModulesChanged, restore_modes, training_modes
from dptext.privacy.proof.adopt import proof_plan
from dptext.privacy.proof.independence import check_training_precision
from dptext.privacy.proof.probe_checks import probe_one
from dptext.privacy.proof.reference import ReferenceFailed
from dptext.privacy.proof.patterns import representatives
from dptext.privacy.proof.probe_model import drawn_zero_parameters, probe_precision
from dptext.privacy.proof.cached_gathers import cached_gathers
from dptext.privacy.proof.sharded_probe import DISAGREE, HALF, agreed, check_same_batch, sharded_view
from dptext.privacy.proof.synthetic import output_functional_loss, synthetic_batches, synthetic_token_batch
from dptext.privacy.proof.stack import applied, check_whole_forward, plan_cut
from dptext.privacy.proof.vocabulary import (ids_below, kept_gradients, plan_vocabulary_cut, sharded_cut,
                                             token_vocabulary, vocabulary_applied)
from dptext.privacy.sharding.fsdp_controls import fsdp_modules, reset_after_failure
from dptext.privacy.sharding.fsdp_precision import gathered_as_stored, half_policy, half_stored

REFERENCE_FAILED = ("The start-up probe's reference, plain per-example autograd without the engine, fails on this "
                    "model's synthetic batch ({}; e.g. an input changed in place after a layer read it, or "
                    "an fp32-only mask), so nothing can prove the clipping exact; fix the model's forward or "
                    "freeze the layers involved.")
FP64_PARAMETERS = 50_000_000  # up to this size the probe runs on an fp64 copy of the model (its peak: ~2 extra
# fp64 model sizes, negligible here); above it, in the model's own precision with fp32 sums, so that the proof
# costs about one training step's memory at any scale (docs/privacy_engine.md, "What the proof covers")
PROBE_SHAPES = ((5, 3), (4, 4))  # (examples, positions): B ≠ T (B = 5: not a tiny label count or hidden size, so
# the functional fallback can learn which inputs carry the batch), then B = T


@dataclass
class LayerRow:
    name: str
    kind: str
    rule: str
    status: str = "not reached"  # exact | refused | not reached (no probe call reached it)
    why: str = ""


@dataclass
class ProbeReport:
    rows: dict[nn.Module, LayerRow]
    loss_problem: str | None = None
    state_problem: str | None = None  # model state a training forward changes (released without noise)
    seconds: float = 0.0
    shapes: tuple = PROBE_SHAPES
    compared: int = 0  # layers compared with brute force themselves; the others share their pattern's verdict
    notes: list[str] = field(default_factory=list)
    modes: tuple = ()  # each module's train/eval flag the probe ran in (dropout, batch statistics on or off)
    training_dtype: Any = None  # the autocast dtype its training-precision re-draws ran under (None: none)
    plan: tuple = ()  # the engine settings the proof is about (``proof_plan``)

    def refuse(self, module: nn.Module, why: str) -> None:
        row = self.rows[module]
        if row.status != "refused":
            row.status, row.why = "refused", why

    def refused(self) -> list[LayerRow]:
        return [row for row in self.rows.values() if row.status == "refused"]

    def table(self) -> list[dict[str, str]]:
        return [vars(row).copy() for row in self.rows.values()]

    def raise_if_refused(self) -> None:
        if self.loss_problem:
            raise UserError(f"The start-up probe refused the loss: {self.loss_problem}.")
        if self.state_problem:
            raise UserError(f"The start-up probe refused {self.state_problem}.")
        for row in self.refused():
            raise UserError(f"The start-up probe refused layer '{row.name}' ({row.kind}): {row.why}; freeze it, "
                            "train it through LoRA, or try another clipping_mode (`dptext check --model` lists "
                            "every layer).")
        if not any(row.status == "exact" for row in self.rows.values()):
            raise UserError("The start-up probe compared no layer with brute force (no trained layer received a "
                            "gradient on its synthetic batch), so it proves nothing; give a probe loss that reaches "
                            "the trained layers.")


def probe_dtype(model: nn.Module, device: torch.device) -> torch.dtype | None:
    """fp64 for a model of up to ``FP64_PARAMETERS`` parameters, else None (its own precision); fp32 for a
    half-precision model (bf16 rounding would hide a wrong path)."""
    if device.type == "mps":
        return None
    floating = [p for p in model.parameters() if p.is_floating_point()]
    if sum(p.numel() for p in floating) <= FP64_PARAMETERS:
        return torch.float64
    return torch.float32 if any(p.dtype in (torch.float16, torch.bfloat16) for p in floating) else None


def engine_hooks(engine: Any) -> set[int]:
    """Ids of the hooks the engine installed (the recorder's, the outside-read detector's), by handle id."""
    handles = list(getattr(engine.recorder, "_handles", [])) + list(getattr(engine.outside_reads, "_handles", []))
    return {handle.id for handle in handles if hasattr(handle, "id")}  # a model patch is no hook


def findings(report: ProbeReport) -> tuple:
    """What the probe has found so far, to be restored by ``restore_findings``."""
    return {module: (row.status, row.why) for module, row in report.rows.items()}, report.loss_problem, \
        report.state_problem


def restore_findings(report: ProbeReport, found: tuple) -> None:
    rows, report.loss_problem, report.state_problem = found
    for module, (status, why) in rows.items():
        report.rows[module].status, report.rows[module].why = status, why


def reset(report: ProbeReport, engine: Any) -> None:
    """Forget a probe attempt's findings before another one (the whole stack, the model's own dtype)."""
    engine.zero_grad()
    for row in report.rows.values():
        row.status, row.why = "not reached", ""
    report.loss_problem = report.state_problem = None


def probe(engine: Any, make_batch=None, loss_fn=None, shapes=PROBE_SHAPES, dtype: Any = "auto",
          cut_stacks: bool = True, training_dtype: torch.dtype | None = None) -> ProbeReport:
    """Verify ``engine`` on synthetic batches; returns the per-layer report (see the module docstring).

    ``dtype``: the probe's precision ("auto": ``probe_dtype``; None: the model's own). ``cut_stacks``: after the
    first shape on the whole model, run the others on each block stack cut after its last block that differs
    (``proof.stack``); False runs every shape on the whole model. ``training_dtype``: the autocast dtype training
    runs under (default: the autocast active here, as when the probe runs at the first training forward)."""
    model = engine.model
    device = engine.params[0].device
    if training_dtype is None and torch.is_autocast_enabled(device.type):
        training_dtype = torch.get_autocast_dtype(device.type)
    # FSDP2: every rank together (``proof.sharded_probe``), weights gathered as stored (``fsdp_precision``).
    # The comparisons run outside the caller's autocast: inside it an fp32 probe (models above FP64_PARAMETERS)
    # computed in bf16 and refused every layer (the first GPU run, 1.1B Llama at its first bf16 training forward);
    # training's own precision is what ``in_training_precision`` re-draws, under ``training_dtype``'s autocast.
    with gathered_as_stored(model), sharded_view(engine, model) as view, torch.autocast(device.type, enabled=False):
        if view is not None and half_stored(model) is not None:
            raise UserError(HALF.format(half_stored(model)))
        with cached_gathers(engine):  # FSDP2: a unit's later gathers served from a copy of its first
            report = _probe(engine, make_batch, loss_fn, shapes, None if view is not None else dtype, cut_stacks)
        problem = agreed((report.table(), bool(report.loss_problem), bool(report.state_problem))) \
            if view is not None else None
    if problem is not None:
        raise UserError(DISAGREE.format(problem))
    report.training_dtype = training_dtype
    probed_in = None if view is not None else probe_dtype(model, device) if dtype == "auto" else dtype
    if not (report.loss_problem or report.refused()) and (training_dtype is not None or half_policy(model) or (
            probed_in is not None and probed_in != engine.params[0].dtype)):
        in_training_precision(engine, report, make_batch or synthetic_token_batch(model),
                              loss_fn or output_functional_loss, shapes[0], training_dtype)
    return report


def in_training_precision(engine: Any, report: ProbeReport, make_batch, loss_fn, shape, dtype) -> None:
    """``independence.check_training_precision`` on the first shape's batch, where training computes in another
    precision than the probe's comparisons (a bf16 autocast or FSDP2 policy, fp32 against the fp64 probe)."""
    batch, redraw = synthetic_batches(make_batch, *shape, 0, engine.params[0].device)
    computes_in = dtype or half_policy(engine.model) or engine.params[0].dtype
    try:
        check_training_precision(engine, report, batch, redraw, loss_fn, dtype, computes_in)
    except ReferenceFailed as error:
        raise UserError(REFERENCE_FAILED.format(error)) from error
    finally:
        engine.zero_grad()
        for unit in fsdp_modules(engine.model):  # forwards without a backward leave the root gathered
            unit.reshard()


def _probe(engine: Any, make_batch, loss_fn, shapes, dtype, cut_stacks: bool) -> ProbeReport:
    model = engine.model
    whole_vocabulary = getattr(loss_fn, "needs_whole_vocabulary", False)  # compares logits with another model's
    rows = sharded_cut(plan_vocabulary_cut(model, token_vocabulary(model)), engine) \
        if cut_stacks and not whole_vocabulary else None  # (FSDP2: the matrices its passes register are cut)
    make_batch = make_batch or synthetic_token_batch(model)
    loss_fn = loss_fn or output_functional_loss
    report = ProbeReport({m: LayerRow(engine.names[m], type(m).__name__, type(rule).__name__.removesuffix("Rule"))
                          for m, (rule, _) in engine.tracked.items()}, shapes=tuple(shapes),
                         modes=training_modes(model), plan=proof_plan(engine))
    start = time.perf_counter()
    device = engine.params[0].device
    decided_by = representatives(model, engine.tracked, engine.names, engine_hooks(engine))
    report.compared = sum(1 for module, rep in decided_by.items() if rep is module)
    cut = plan_cut(model, engine.tracked, decided_by, engine_hooks(engine)) if cut_stacks else None

    def probe_batches(batches) -> None:
        for batch, redraw in batches:
            probe_one(engine, report, batch, loss_fn, device, redraw, decided_by)

    def draw(shapes_from: int, vocabulary=None) -> list:
        """The synthetic batches of ``shapes[shapes_from:]``, drawn with the model's vocabulary sizes cut to
        ``vocabulary`` (a task's batch reads them: ``dptext.tasks.probe_batches.vocab_size``)."""
        batches = []
        with vocabulary_applied(vocabulary):
            for number, (examples, positions) in list(enumerate(shapes))[shapes_from:]:
                batch, redraw = synthetic_batches(make_batch, examples, positions, number, device)
                check_same_batch(engine, batch)  # FSDP2: every rank proves the same batch
                batches.append((batch, redraw if examples > 1 else None))
        return batches

    def run_probes(precision) -> None:
        with probe_precision(model, precision), drawn_zero_parameters(engine.params):
            if cut is None and rows is None:
                return probe_batches(draw(0))
            probe_batches(draw(0)[:1])  # B ≠ T on the whole model: every check, at every depth
            first_shape = findings(report)
            later = draw(1, rows)
            vocabulary = rows if rows and all(ids_below(batch, rows.rows) for batch, _ in later) else None
            later = later if vocabulary is rows else draw(1)  # a batch with ids beyond the cut: whole vocabulary
            try:  # B = T on the blocks that differ (``proof.stack``) and the first rows of the vocabulary
                with applied(cut), vocabulary_applied(vocabulary):  # (``proof.vocabulary``)
                    probe_batches(later)
            except UserError:
                raise
            except Exception as error:  # noqa: BLE001 - this forward (or its reference) does not run on the cut
                # stack or vocabulary: prove the later shapes whole (a reference that fails again is the finding),
                reset_after_failure(model)  # FSDP2: a pass cut short by the failure leaves its state mid-pass
                restore_findings(report, first_shape)  # keeping what the first shape found
                engine.zero_grad()
                report.notes.append(f"proved the whole stack and vocabulary: the model's forward fails on the cut "
                                    f"({type(error).__name__})")
                later = draw(1)
                return probe_batches(later)
            for batch, _ in later:
                check_whole_forward(engine, report, batch, loss_fn, device)

    def run_or_refuse(precision) -> None:
        try:
            run_probes(precision)
        except ReferenceFailed as error:  # the brute-force reference itself fails: nothing proves the engine
            raise UserError(REFERENCE_FAILED.format(error)) from error

    def run_in_precision(precision) -> None:
        if precision is None:
            return run_or_refuse(None)
        try:
            run_probes(precision)
        except (RuntimeError, TypeError) as error:  # code that hard-wires a dtype: probe in the model's own
            reset(report, engine)
            report.notes.append(f"probed in the model's dtype: fp64 failed ({type(error).__name__})")
            run_or_refuse(None)

    try:
        with kept_gradients(rows):
            run_in_precision(probe_dtype(model, device) if dtype == "auto" else dtype)
    except (ValueError, KeyError) as error:  # the synthetic batch lacks an input the model needs (T5's decoder ids)
        raise UserError(f"The start-up probe could not run this model on its synthetic batch ({type(error).__name__} "
                        "in the forward); pass make_batch and loss_fn that fit the model to engine.verify(), or use "
                        "a task that builds its own probe batch.") from error
    finally:
        engine.recorder.probing = False
        engine.zero_grad()
        release_freed_memory()  # the float64 copy of the model: several GB that training will not reuse
        try:
            restore_modes(model, report.modes)  # each module's own flag (a BatchNorm kept in eval mode stays so)
        except ModulesChanged as error:  # BigBird swaps its attention for short sequences
            raise UserError("The model replaced some of its own modules during the start-up probe's forward (an "
                            "attention implementation chosen by sequence length), so the probe cannot prove the "
                            "forward training runs; fix the model's choice (e.g. attention_type='original_full').") \
                from error
    report.seconds = time.perf_counter() - start
    for row in report.rows.values():
        if row.status == "not reached":
            row.why = "no probe call reached it (unused layer); it receives noise only"
    return report


