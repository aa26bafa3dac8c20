"""The planned parameters the engine takes out of autograd, and what the user asked of them since (issue 43).

Book-keeping and per_sample compute every weight gradient from their hooks, so the engine sets the planned
parameters' ``requires_grad`` to False (autograd then skips the weight-gradient GEMMs). A layer the user freezes
after the engine was built (``layer.requires_grad_(False)``, ``p.requires_grad = False``) therefore changes no flag
that could be seen, and the engine went on clipping, noising and updating it. Each such parameter is given the
class ``EngineParameter``, a ``nn.Parameter`` that behaves the same except that an assignment of False while
autograd already has it off is kept as a *freeze* (``frozen_since_plan``), which the step refuses until
``engine.replan()``. Reading ``requires_grad`` still gives autograd's own flag, so code that saves and restores
it (the probe's brute-force reference, a checkpoint reader) is unchanged and never reads as a freeze.

FSDP2's sharded parameters are DTensors (FSDP2 copies their ``requires_grad`` to the gathered weights): they
are given ``EngineDTensor``, a DTensor subclass that records a freeze the same way and is dispatched as a DTensor
(its operations return plain DTensors). Ghost clipping leaves the flags alone: there a frozen parameter is simply
one whose flag went False. So does the hybrid for the parameters of its ghost-treated layers (``long_sequences``:
their clipped sums are autograd's), which are marked (``keep_in_autograd``) so that a freeze is seen the same way.
Parameters of any other class (quantised weights) keep their class, and a freeze after the plan is not seen for
them in book-keeping and per_sample.
"""

from __future__ import annotations

import copy
import functools
import sys
from contextlib import contextmanager

import torch
from torch import nn

_FLAG = torch._C.TensorBase.requires_grad  # autograd's own flag, under the property below
_FROZEN = "_dptext_frozen_since_plan"
_IN_AUTOGRAD = "_dptext_ghost_treated"  # a book-keeping parameter the plan left in autograd (hybrid)


def _note(param: torch.Tensor, requires_grad: bool) -> None:
    # False while the flag is already False can only be the user's: the engine's own changes, the probe's
    # and the checkpoint reader's switch it on first and then restore it. The mark stays until replan().
    if not requires_grad and not _FLAG.__get__(param):
        param.__dict__[_FROZEN] = True


class _NotesFreezes:
    """``requires_grad`` as autograd's flag, with a freeze since the plan recorded (``_note``)."""

    __slots__ = ()  # adds nothing to the instance layout, so a parameter's class can be swapped for ours and back

    @property
    def requires_grad(self) -> bool:
        return _FLAG.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        _note(self, bool(value))
        _FLAG.__set__(self, value)

    def requires_grad_(self, requires_grad: bool = True):
        _note(self, bool(requires_grad))
        return super().requires_grad_(requires_grad)


class EngineParameter(_NotesFreezes, nn.Parameter):
    """A planned parameter that book-keeping or per_sample took out of autograd (see the module docstring)."""

    plain_class = nn.Parameter

    def __repr__(self) -> str:  # as nn.Parameter's (the class is the engine's business)
        return "Parameter containing:\n" + repr(self.detach())

    def __deepcopy__(self, memo):
        # a copy of the model is not planned: a plain Parameter (nn.Parameter would copy the class)
        copied = nn.Parameter(self.data.clone(memory_format=torch.preserve_format), _FLAG.__get__(self))
        memo[id(self)] = copied
        return copied


@functools.cache
def _engine_dtensor() -> type:
    """``EngineDTensor``, made on first use: importing DTensor costs time that unsharded runs need not spend."""
    from torch.distributed.tensor import DTensor

    class EngineDTensor(_NotesFreezes, DTensor):
        """An FSDP2-sharded planned parameter that book-keeping or per_sample took out of autograd. Its operations
        go through DTensor's own ``__torch_dispatch__`` for subclasses, which runs them on plain DTensors."""

        __slots__ = ()
        plain_class = DTensor

        def __deepcopy__(self, memo):  # a copy is not planned: a plain DTensor, without the mark
            with _as_plain(self):
                copied = copy.deepcopy(self, memo)
            copied.__dict__.pop(_FROZEN, None)
            return copied

        def __reduce_ex__(self, protocol):  # pickled as a plain DTensor (this class is made at run time)
            with _as_plain(self):
                return DTensor.__reduce_ex__(self, protocol)

    for supported in _foreach_lists():  # as DTensor registers itself: optimizers keep their foreach kernels
        supported.append(EngineDTensor)
    return EngineDTensor


def _foreach_lists() -> list[list]:
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    return [optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types]


@contextmanager
def _as_plain(param: torch.Tensor):
    engine_class = type(param)
    param.__class__ = engine_class.plain_class
    try:
        yield
    finally:
        param.__class__ = engine_class


def _engine_class(param: torch.Tensor) -> type | None:
    """The engine's class for a parameter of exactly ``nn.Parameter`` or FSDP2's DTensor; None for any other (its
    subclasses, quantised weights: they keep their class)."""
    if type(param) is nn.Parameter:  # noqa: E721
        return EngineParameter
    dtensor = sys.modules.get("torch.distributed.tensor")  # imported wherever a DTensor exists
    if dtensor is not None and type(param) is dtensor.DTensor:
        return _engine_dtensor()
    return None


def take_out_of_autograd(params: list[nn.Parameter]) -> None:
    """Book-keeping and per_sample: no weight gradients from autograd; later freezes are recorded."""
    for param in params:
        param.__dict__.pop(_FROZEN, None)  # a mark that travelled with a copy or a pickle is not this plan's
        param.requires_grad_(False)
        engine_class = _engine_class(param)
        if engine_class is not None:
            param.__class__ = engine_class


def keep_in_autograd(params) -> None:
    """The hybrid's ghost-treated parameters: left in autograd (pass 2 forms their sums), a freeze seen as in ghost
    clipping."""
    for param in params:
        param.__dict__[_IN_AUTOGRAD] = True


def frozen_since_plan(param: nn.Parameter, clipping_mode: str) -> bool:
    """Whether the user froze ``param`` after the engine planned it."""
    if clipping_mode == "ghost" or param.__dict__.get(_IN_AUTOGRAD, False):
        return not param.requires_grad
    return bool(param.__dict__.get(_FROZEN, False))


def give_back(params: list[nn.Parameter], keep: set | None = None) -> None:
    """Undo ``take_out_of_autograd`` (``replan``, ``detach``): each parameter is of its plain class again and
    requires grad unless it was frozen since the plan or is not in ``keep`` (no longer the model's)."""
    for param in params:
        frozen = bool(param.__dict__.pop(_FROZEN, False))
        if param.__dict__.pop(_IN_AUTOGRAD, False):
            frozen = not param.requires_grad
        if isinstance(param, _NotesFreezes):
            param.__class__ = type(param).plain_class
        param.requires_grad_(not frozen and (keep is None or param in keep))


def carry_trainable_by_name(model: nn.Module, params: list[nn.Parameter], planned_names: set[str]) -> None:
    """``replan`` in book-keeping and per_sample: the old plan's parameters are given back, and a parameter that
    replaced one of them under the same name (``load_state_dict(assign=True)``, a dtype conversion that makes new
    objects) copied the engine's False flag, so it is trained again as the one it replaced was."""
    frozen = {param for param in params if frozen_since_plan(param, "bookkeeping")}
    wanted = planned_names - {name for name, param in model.named_parameters(remove_duplicate=False)
                              if param in frozen}
    give_back(params, set(model.parameters()))
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in wanted and not param.requires_grad:
            param.requires_grad_(True)
