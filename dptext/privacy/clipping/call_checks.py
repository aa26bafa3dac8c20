"""What runs at a tracked layer's call that the plan did not see, checked at the call itself.

The plan records each tracked layer's forward hooks and torch's global module hooks, and the step compares them
at ``accumulate()``; a hook registered only around a forward (a profiler's or a tracker's context manager) and
removed before ``accumulate()``, or a ``TorchFunctionMode`` or ``TorchDispatchMode`` entered around the forward,
runs code the rules do not describe (a second use of the layer's weight, an op's output scaled below autograd) and
is gone by then. A session-25 red team built the hooks and function mode (one layer's gradient 1.5x, accepted), a
later one the dispatch mode. So the recorder asks at every call, outside the start-up probe (whose own mode and
hooks are the probe's): a problem found here makes the use untrusted, and the step refuses it in one sentence.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from dptext.errors import UserError
from dptext.privacy.clipping.plan import global_hook_keys

HOOKS_AT_CALL = ("its forward hooks at this call differ from those the engine planned with (a hook registered only "
                 "around the forward counts); call engine.replan() after changing hooks")
GLOBAL_AT_CALL = ("a global module hook at this call differs from those the engine planned with (one registered "
                  "only around the forward counts); call engine.replan() after changing global hooks")
MODE_AT_CALL = ("a TorchFunctionMode ({}) is active during its call, code that can use its weight a second time "
                "unseen by its rule; leave the forward outside such modes")
DISPATCH_AT_CALL = ("a TorchDispatchMode ({}) is active during its call, code below autograd that can change what it "
                    "computes (scale an op's output, use its weight a second time) unseen by its rule; leave the "
                    "forward outside such modes")
# torch's own dispatch modes of ordinary training, matched by exact type (a subclass is someone else's code): selective
# activation checkpointing's, which keep chosen ops' outputs in the forward and hand the same values back in the
# recompute. FSDP2, autocast and plain checkpointing use none (tests/test_call_time_checks.py).
TORCH_OWN = tuple(getattr(torch_checkpoint, name) for name in ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode")
                  if hasattr(torch_checkpoint, name))
# tracing's modes (fake tensors, make_fx's proxies, functionalization) sit in slots of their own, off the stack
INFRA_KEYS = tuple(torch._C._TorchDispatchModeKey.__members__.values()) if hasattr(torch._C, "_TorchDispatchModeKey") \
    else ()
PYTHON_KEY, included = torch._C.DispatchKey.Python, torch._C._dispatch_tls_is_dispatch_key_included


def foreign_code_at_call(module: nn.Module, planned_hooks: tuple, planned_globals: tuple | None) -> str | None:
    """Why ``module``'s call runs code the plan did not see, or None. ``planned_hooks``: the module's hook keys at
    the plan (``capture.hook_keys``); ``planned_globals``: ``global_hook_keys()`` at the plan (None: not known)."""
    if (tuple(module._forward_pre_hooks), tuple(module._forward_hooks)) != planned_hooks:
        return HOOKS_AT_CALL
    if planned_globals is not None and global_hook_keys() != planned_globals:
        return GLOBAL_AT_CALL
    modes = [mode for mode in _get_current_function_mode_stack() if not isinstance(mode, DeviceContext)]
    if modes:  # torch.device(...) as a context manager is a mode too: it only places new tensors
        return MODE_AT_CALL.format(type(modes[0]).__name__)
    # any dispatch mode, on the stack or in an infra slot, puts the Python key in the thread's include set: without
    # it (every ordinary step) the dispatch check is this one C call
    return dispatch_mode_at_call() if included(PYTHON_KEY) else None


def dispatch_mode_at_call() -> str | None:
    """Why the ``TorchDispatchMode``s active now make a layer's call untrusted, or None."""
    modes = [mode for mode in _get_current_dispatch_mode_stack() if type(mode) not in TORCH_OWN]
    modes += [mode for mode in map(torch._C._get_dispatch_mode, INFRA_KEYS) if mode is not None]
    return DISPATCH_AT_CALL.format(type(modes[0]).__name__) if modes else None


def selective_checkpoint_at_call() -> bool:
    """Whether selective activation checkpointing's own modes are active now (a use recorded in a SAC region)."""
    return included(PYTHON_KEY) and any(type(mode) in TORCH_OWN for mode in _get_current_dispatch_mode_stack())


SELECTIVE_CHECKPOINT = ("Layer '{}' ran under selective activation checkpointing (torch.utils.checkpoint with "
                        "context_fn=create_selective_checkpoint_contexts), which allows one backward pass per region "
                        "where {} runs two; use clipping_mode='bookkeeping' (without max_stored_bytes) or plain "
                        "activation checkpointing (no context_fn).")


def refuse_selective_checkpoint(engine, two_passes: str) -> None:
    """Before the first of two backward passes (ghost clipping, the hybrid's ghost treatment): a use recorded under
    selective checkpointing would make torch's second pass fail half-way with its own error; one sentence instead."""
    marked = [use.module for use in engine.recorder.uses if use.selective_checkpoint]
    if marked:  # refused, the forward's records are dropped
        engine.recorder.take_uses()
        engine.outside_reads.clear()
        raise UserError(SELECTIVE_CHECKPOINT.format(engine.names.get(marked[0], type(marked[0]).__name__), two_passes))


MODE_AROUND_ENGINE = ("engine.{}() was called inside a {} ({}), code that can change the gradients of its backward "
                      "pass or the noise of its step unseen by the engine's checks; call the engine outside such "
                      "modes (torch.device(...) as a context manager is accepted).")


def refuse_mode_around(call: str) -> None:
    """At the start of the engine's ``accumulate``/``step`` (and eDP-SGD's ``close_unit``): no user function or
    dispatch mode is active, nor torch's selective-checkpointing modes (only ever active inside a forward or its
    recompute). A mode around the engine's own work could rescale the backward's output gradients, or zero the
    noise draw, where no call check sees it (a red team's cases, tests/test_call_time_checks.py)."""
    modes = [mode for mode in _get_current_function_mode_stack() if not isinstance(mode, DeviceContext)]
    if modes:
        raise UserError(MODE_AROUND_ENGINE.format(call, "TorchFunctionMode", type(modes[0]).__name__))
    if included(PYTHON_KEY):
        modes = list(_get_current_dispatch_mode_stack())
        modes += [mode for mode in map(torch._C._get_dispatch_mode, INFRA_KEYS) if mode is not None]
        if modes:
            raise UserError(MODE_AROUND_ENGINE.format(call, "TorchDispatchMode", type(modes[0]).__name__))


ENGINE_CLASSES = "dptext.privacy.clipping.owned_params"  # EngineParameter, EngineDTensor: a freeze noted, else plain
SUBCLASS_AT_CALL = ("its {} is a tensor subclass ({}), whose __torch_function__ can change what the layer computes "
                    "(mix examples, use its weight twice) unseen by its rule; pass plain tensors to the model")


def subclass_at_call(inputs: tuple, output, weights: tuple = ()) -> str | None:
    """Why a layer's call is untrusted for its tensors' types (session-26 red team: a ``__torch_function__``
    subclass in the training batch, none in the probe's, mixed every row into example 0's at each linear), or
    None. Plain tensors and parameters only: its inputs, its output and its tracked weights as the call sees them."""
    for what, value in [*(("input", each) for each in inputs), ("output", output), *(("weight", w) for w in weights)]:
        if isinstance(value, torch.Tensor) and type(value) not in (torch.Tensor, nn.Parameter) \
                and type(value).__module__ != ENGINE_CLASSES:  # the engine's own parameter classes are plain ones
            return SUBCLASS_AT_CALL.format(what, type(value).__name__)
    return None


def subclass_in_batch(args: tuple, kwargs: dict) -> str | None:
    """Why a model call is untrusted for a tensor subclass anywhere in its inputs (nested in lists, tuples and
    mappings), or None: it need not reach a tracked layer to mix examples (a padding mask whose multiply handed
    back plain rows of example 0, session-26 red team), and the probe's synthetic batches never carry one."""
    pending, seen = [*args, *kwargs.values()], 0
    while pending and seen < 10_000:  # a batch is a few tensors; the bound keeps a cyclic structure finite
        value, seen = pending.pop(), seen + 1
        if isinstance(value, torch.Tensor):
            if type(value) not in (torch.Tensor, nn.Parameter):
                return SUBCLASS_AT_CALL.format("model input", type(value).__name__)
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
        elif isinstance(value, Mapping):
            pending.extend(value.values())
    return None


def weights_at_call(module: nn.Module, names: tuple) -> tuple:
    """The tracked parameters ``names`` of ``module`` as registered now (under FSDP2, the gathered ones)."""
    found = []
    for name in names:
        try:
            found.append(module.get_parameter(name))
        except AttributeError:
            continue
    return tuple(found)

