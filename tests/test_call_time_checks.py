"""What runs at a tracked layer's call that the plan did not see is refused at the step, even when it is gone by
``accumulate()`` (``dptext/privacy/clipping/call_checks.py``; a session-25 red team's cases, one process): a
forward hook or a global module hook registered only around the forward, a ``TorchFunctionMode`` entered around
it. ``torch.device(...)`` as a context manager (also a function mode) is accepted."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from fsdp_models import losses, tiny_lm, token_ids

from dptext.errors import UserError
from dptext.privacy import PrivacyEngine


def second_use(module, args, output):
    """A second use of the layer's weight, which its rule does not describe (1.5x its gradient)."""
    return output + 0.5 * nn.functional.linear(args[0], module.weight)


class SecondUse(TorchFunctionMode):
    """Adds the second use to block 1's layer from inside a function mode (no hook registered anywhere)."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is nn.functional.linear and len(args) > 1 and args[1] is self.weight:
            return out + 0.5 * func(args[0], self.weight)
        return out


@contextmanager
def layer_hook(model):
    handle = model.blocks[1].fc.register_forward_hook(second_use)
    yield
    handle.remove()


@contextmanager
def global_hook(model):
    handle = nn.modules.module.register_module_forward_hook(
        lambda module, args, output: second_use(module, args, output) if module is model.blocks[1].fc else None)
    yield
    handle.remove()


AROUND_THE_FORWARD = {"layer_hook": (layer_hook, "forward hooks at this call"),
                      "global_hook": (global_hook, "global module hook at this call"),
                      "function_mode": (lambda model: SecondUse(model.blocks[1].fc.weight), "TorchFunctionMode")}


def engine_for(model, mode):
    engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                           max_grad_norm=0.5, expected_batch_size=4, dataset_size=12, clipping_mode=mode,
                           verify=False)
    return engine


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
@pytest.mark.parametrize("case", list(AROUND_THE_FORWARD))
def test_code_active_only_around_the_forward_is_refused_at_the_step(case, mode):
    model = tiny_lm()
    engine = engine_for(model, mode)
    around, words = AROUND_THE_FORWARD[case]
    with around(model):
        loss = losses(model, token_ids()[:4])
    with pytest.raises(UserError, match=words + ("|read outside the layers" if mode == "ghost" else "")):
        engine.accumulate(loss)  # (ghost's own outside-read check may speak first)


def test_a_device_context_around_the_forward_is_accepted():
    model = tiny_lm()
    engine = engine_for(model, "bookkeeping")
    with torch.device("cpu"):
        loss = losses(model, token_ids()[:4])
    engine.accumulate(loss)
    engine.step()
    assert engine.steps == 1
