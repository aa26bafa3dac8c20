"""The probe's hooked forward: the loss with the engine's hooks, the structural checks that need the pass itself
(expansions of a batch-1 input, tracked parameters read outside every module that owns them), under FSDP2 too."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from dptext.privacy.proof.independence import plain_loss
from dptext.privacy.proof.reference import same_randomness
from dptext.privacy.proof.sharded_probe import gathered_unit, planned, view_of

METADATA = {"__get__", "size", "dim", "numel", "is_floating_point", "data_ptr", "stride", "is_contiguous",
            "element_size", "__len__", "__format__", "__repr__", "__hash__", "__eq__"}
OUTSIDE_READ = ("its parameter '{}' is also read outside the module (a functional use or a second module), a "
                "path its rule does not see")


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


def engine_forward(engine, report, batch, loss_fn, device):
    """The loss with the engine's hooks and the outside-read detector; returns (loss, uses) or None if refused."""
    recorder = engine.recorder
    owners: dict[int, set[nn.Module]] = {}
    view = view_of(engine)
    for module, (_, names) in engine.tracked.items():
        for name in names:
            param = planned(engine, module, name)
            for read in (param, view.target(param)) if view is not None else (param,):  # a shard and what the
                owners.setdefault(id(read), set()).add(module)  # layers compute with under FSDP2
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
            plain_loss(engine, batch, loss_fn, device)  # the model's own forward fails: ReferenceFailed says so
            raise
        for module in expanded:
            report.refuse(module, f"broadcasting its batch-1 input to the batch breaks the model's forward "
                                  f"({type(error).__name__})")
        return None
    finally:
        for handle in handles:
            handle.remove()
    for module, args, output in recorder.expansions:
        with torch.no_grad(), recorder.paused(), gathered_unit(engine, module):  # FSDP2: the pass is over
            alone = module(*args)
        if output is None or not _broadcasts_to(alone, output):
            report.refuse(module, "broadcasting its batch-1 input to the batch changes its output")
    for module, (_, names) in engine.tracked.items():
        for name in names:
            param = planned(engine, module, name)
            if id(param) in reads.outside or (view is not None and id(view.target(param)) in reads.outside):
                report.refuse(module, OUTSIDE_READ.format(name))
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
