"""The probe's stack: the second probe shape on the blocks that differ, the first on the whole model.

A transformer repeats one block L times (``model.layers``, ``h``, ``block``). Blocks equal in everything that
decides what their code does — every module's class, plain instance settings, parameters (names, shapes, dtypes,
which are trained) and no per-instance code (a replaced ``forward``, a foreign hook) anywhere in the block — run
the same code on tensors of the same shapes: the use-pattern argument of ``proof.patterns``, lifted from a layer to
its whole block. The probe's first shape (B ≠ T) runs every check on the whole model, so a mix at any depth, in a
block or in the loop around them, reaches the compared layers below it as before. Its second shape (B = T, the
layouts that confuse examples with positions) runs the engine's pass, the brute-force reference and the hooked
re-draws on the model with each stack cut after its last block that differs from every block before it: the
blocks cut away share their pattern-mates' verdicts (``probe_checks.share_verdicts``), and the whole model gets one
hooked forward at that shape for what is per layer or per model (in-place changes, parameters read outside their
module, batch-1 expansions, rows flagged by the recorder, buffers, the loss's shape). The cut keeps a prefix, so
every kept block keeps its index and its module objects (parameters, hooks); a model whose forward does not run on
the cut falls back to the whole model (docs/privacy_engine.md, "What the proof covers at scale").
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from torch import nn

from dptext.privacy.proof.patterns import _instance_code, instance_settings
from dptext.privacy.proof.buffers import BUFFER_CHANGED, buffer_snapshot, changed_buffer
from dptext.privacy.proof.sharded_probe import shard_of
from dptext.privacy.proof.hooked_forward import engine_forward
from dptext.privacy.proof.probe_checks import loss_shape_problem

STACK_NAMES = frozenset({"layers", "layer", "h", "block", "blocks"})  # the attribute transformers keep their
# repeated blocks under; a list named otherwise (``experts``: routed by index) is never cut


@dataclass
class Cut:
    stacks: list[tuple[nn.Module, str, nn.ModuleList, int]] = field(default_factory=list)  # (parent, attribute,
    # the whole list, blocks kept)
    dropped: dict[nn.Module, nn.Module] = field(default_factory=dict)  # tracked layer cut away → its pattern's
    # representative


def block_key(block: nn.Module, own_hooks: set[int]) -> tuple | None:
    """Everything that decides what a block's code does, or None when the block runs per-instance code."""
    entries = []
    for name, module in block.named_modules():
        if _instance_code(module, own_hooks):
            return None
        params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters(recurse=False))
        entries.append((name, type(module), instance_settings(module), params))
    return tuple(entries)


def _stacks(model: nn.Module):
    """(parent, attribute, list) for each repeated-block list, outermost first; lists inside one are not cut."""
    inside: set[int] = set()
    for parent in model.modules():
        if id(parent) in inside:
            continue
        for attribute, child in parent._modules.items():
            if isinstance(child, nn.ModuleList) and attribute in STACK_NAMES and len(child) > 1 \
                    and len({type(block) for block in child}) == 1:
                inside.update(id(m) for m in child.modules())
                yield parent, attribute, child


def plan_cut(model: nn.Module, tracked, decided_by: dict[nn.Module, nn.Module], own_hooks: set[int]) -> Cut | None:
    """Where each stack can end for the probe's numeric part; None when no block can be cut away."""
    cut = Cut()
    for parent, attribute, blocks in _stacks(model):
        seen, last_needed = set(), 0
        for index, block in enumerate(blocks):
            key = block_key(block, own_hooks)
            representative = any(decided_by.get(m) is m for m in block.modules())
            if key is None or key not in seen or representative:
                last_needed = index
            seen.add(key)
        dropped = {m: decided_by[m] for block in list(blocks)[last_needed + 1:] for m in block.modules()
                   if m in tracked}
        kept = {m for block in list(blocks)[:last_needed + 1] for m in block.modules()}
        if dropped and all(rep in kept or rep not in dropped and rep is not m for m, rep in dropped.items()):
            cut.stacks.append((parent, attribute, blocks, last_needed + 1))
            cut.dropped.update(dropped)
    return cut if cut.stacks else None


@contextmanager
def applied(cut: Cut | None):
    """The model with each stack cut (the same module objects, so the same parameters and hooks), restored after."""
    try:
        for parent, attribute, blocks, kept in cut.stacks if cut else ():
            parent._modules[attribute] = blocks[:kept]
        yield
    finally:
        for parent, attribute, blocks, _ in cut.stacks if cut else ():
            parent._modules[attribute] = blocks


def check_whole_forward(engine, report, batch, loss_fn, device) -> None:
    """One hooked forward of the whole model on ``batch``: what the recorder and the forward checks see per layer
    and per model (the module docstring); nothing is accumulated."""
    shards = shard_of(engine)
    before = buffer_snapshot(engine.model, shards)
    forward = engine_forward(engine, report, batch, loss_fn, device)
    engine.recorder.take_uses()  # no backward follows
    if forward is None:
        return
    loss, _ = forward
    changed = changed_buffer(engine.model, before, shards)
    if changed is not None and not report.state_problem:
        report.state_problem = BUFFER_CHANGED.format(changed)
    report.loss_problem = report.loss_problem or loss_shape_problem(batch, loss)
