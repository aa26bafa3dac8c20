"""What runs at a tracked layer's call that the plan did not see, checked at the call itself.

The plan records each tracked layer's forward hooks and torch's global module hooks, and the step compares them
at ``accumulate()``; a hook registered only around a forward (a profiler's or a tracker's context manager) and
removed before ``accumulate()``, or a ``TorchFunctionMode`` entered around the forward, runs code the rules do not
describe (a second use of the layer's weight) and is gone by then. A session-25 red team built both (one layer's
gradient 1.5x, accepted). So the recorder asks at every call, outside the start-up probe (whose own mode and hooks
are the probe's): a problem found here makes the use untrusted, and the step refuses it in one sentence.
"""

from __future__ import annotations

from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext

from dptext.privacy.clipping.plan import global_hook_keys

HOOKS_AT_CALL = ("its forward hooks at this call differ from those the engine planned with (a hook registered only "
                 "around the forward counts); call engine.replan() after changing hooks")
GLOBAL_AT_CALL = ("a global module hook at this call differs from those the engine planned with (one registered "
                  "only around the forward counts); call engine.replan() after changing global hooks")
MODE_AT_CALL = ("a TorchFunctionMode ({}) is active during its call, code that can use its weight a second time "
                "unseen by its rule; leave the forward outside such modes")


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
    return None
