"""What runs at a tracked layer's call that the plan did not see is refused at the step, even when it is gone by
``accumulate()`` (``dptext/privacy/clipping/call_checks.py``; a session-25 red team's cases, one process): a
forward hook or a global module hook registered only around the forward, a ``TorchFunctionMode`` or a
``TorchDispatchMode`` entered around it. ``torch.device(...)`` as a context manager (also a function mode) is
accepted, and so are torch's own dispatch modes of ordinary training (selective activation checkpointing's), beside
autocast and plain checkpointing, which use none. A hook registered between the engine's construction and
``verify()`` is refused by ``verify()`` (it proved it, then every step refused it); ``replan()`` plans with it."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (CheckpointPolicy, _CachingTorchDispatchMode, checkpoint,
                                    create_selective_checkpoint_contexts)
from fsdp_models import VOCAB, TinyLM, losses, tiny_lm, token_ids

from dptext.errors import UserError
from dptext.privacy import PrivacyEngine
from dptext.privacy.clipping import call_checks


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


MATRIX_PRODUCTS = (torch.ops.aten.addmm.default, torch.ops.aten.mm.default, torch.ops.aten.bmm.default)


def reads(args, weight) -> bool:
    return any(isinstance(arg, torch.Tensor) and arg.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
               for arg in args)


class ScaledProduct(TorchDispatchMode):
    """Block 1's matrix product (``addmm`` on its weight) scaled by 1.5 below autograd: no hook, no function mode,
    and autograd still records a plain linear layer, so nothing but the call check sees the layer compute
    something else. ``hits`` counts the products it changed (the tests check that it acted)."""

    def __init__(self, weight):
        super().__init__()
        self.weight, self.hits = weight, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in MATRIX_PRODUCTS and reads(args, self.weight):
            self.hits += 1
            return out * 1.5
        return out


class LookalikeCaching(_CachingTorchDispatchMode):
    """A subclass of selective checkpointing's own mode that scales block 1's product: torch's modes are accepted
    by exact type only."""

    def __init__(self, weight):
        super().__init__(lambda *args, **kwargs: CheckpointPolicy.PREFER_RECOMPUTE, {})
        self.weight = weight

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 1.5 if func in MATRIX_PRODUCTS and reads(args, self.weight) else out


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
                      "function_mode": (lambda model: SecondUse(model.blocks[1].fc.weight), "TorchFunctionMode"),
                      "dispatch_mode": (lambda model: ScaledProduct(model.blocks[1].fc.weight), "TorchDispatchMode"),
                      "lookalike_mode": (lambda model: LookalikeCaching(model.blocks[1].fc.weight),
                                         r"TorchDispatchMode \(LookalikeCaching\)")}


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


def test_a_dispatch_mode_changes_the_step_unseen_but_for_the_call_check(monkeypatch):
    # the design of the dispatch_mode case above: its mode really changes the forward (the loss moves), and with
    # the call check's dispatch part taken out (the code before it) the step goes through silently
    model = tiny_lm()
    engine = engine_for(model, "bookkeeping")
    with torch.no_grad():
        plain = losses(model, token_ids()[:4])
    mode = ScaledProduct(model.blocks[1].fc.weight)
    monkeypatch.setattr(call_checks, "dispatch_mode_at_call", lambda: None, raising=False)
    with mode:
        loss = losses(model, token_ids()[:4])
    assert mode.hits == 1 and not torch.allclose(loss, plain)
    engine.accumulate(loss)
    engine.step()
    assert engine.steps == 1


class Checkpointed(TinyLM):
    """tiny_lm with its blocks under activation checkpointing (use_reentrant=False), plain or selective (SAC)."""

    selective = False

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        for block in self.blocks:
            options = {"context_fn": lambda: create_selective_checkpoint_contexts([torch.ops.aten.addmm.default])} \
                if self.selective else {}
            hidden = checkpoint(block, hidden, use_reentrant=False, **options)
        return self.head(hidden)


def checkpointed(selective: bool) -> nn.Module:
    torch.manual_seed(0)  # tiny_lm's weights
    model = Checkpointed().double()
    model.selective = selective
    return model


def moves(model, engine, autocast: bool = False) -> dict:
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = losses(model, token_ids()[:4])
    engine.accumulate(loss.double())
    engine.step()
    return {name: p.detach() - before[name] for name, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
@pytest.mark.parametrize("case", ["plain", "checkpoint", "selective_checkpoint", "autocast"])
def test_ordinary_steps_are_accepted(case, mode):
    # what torch itself runs in ordinary training: selective checkpointing's two dispatch modes (forward and
    # recompute), plain checkpointing and autocast (none); FSDP2's passes use none either (tests/test_fsdp*.py)
    if case == "selective_checkpoint" and mode == "ghost":
        return  # refused in one sentence: test_ghost_clipping_refuses_selective_checkpointing_before_a_backward_pass
    reference = tiny_lm()
    expected = moves(reference, engine_for(reference, mode))
    model = checkpointed(case == "selective_checkpoint") if "checkpoint" in case else tiny_lm()
    got = moves(model, engine_for(model, mode), autocast=case == "autocast")
    for name, move in expected.items():
        torch.testing.assert_close(got[name], move, **({"rtol": 0.05, "atol": 1e-3} if case == "autocast" else {}))


SELECTIVE = r"ran under selective activation checkpointing .* use clipping_mode='bookkeeping' .* plain activation"


@pytest.mark.parametrize("options", [{"clipping_mode": "ghost"},
                                     {"clipping_mode": "bookkeeping", "max_stored_bytes": 0, "sequence_length": 8}])
def test_ghost_clipping_refuses_selective_checkpointing_before_a_backward_pass(options):
    # two backward passes (ghost, the hybrid's ghost treatment) through a region that allows one: torch's own
    # "Trying to backward an extra time" RuntimeError half-way through before; one sentence now, before either pass
    model = checkpointed(True)
    engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                           max_grad_norm=0.5, expected_batch_size=4, dataset_size=12, verify=False, **options)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UserError, match=SELECTIVE) as refused:
        engine.step(losses(model, token_ids()[:4]))
    assert refused.value.args[0].count(". ") == 0 and not engine.recorder.uses and engine.steps == 0
    assert all(p.grad is None for p in model.parameters())  # no pass ran
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def make_batch(examples, positions, generator):
    return {"input_ids": torch.randint(0, VOCAB, (examples, positions), generator=generator)}


def probe_loss(model, batch):
    return losses(model, batch["input_ids"])


HARMLESS = {"layer_hook": lambda model: model.blocks[1].fc.register_forward_hook(lambda *args: None),
            "global_hook": lambda model: nn.modules.module.register_module_forward_hook(lambda *args: None)}


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
@pytest.mark.parametrize("hook", list(HARMLESS))
def test_a_hook_registered_between_the_plan_and_verify_is_refused_by_verify(hook, mode):
    # the plan is taken at construction and the probe at verify(): verify() proved the hook, then every step
    # refused it ("call replan()"); verify() now refuses first, so nothing is proven that the steps would not run
    model = tiny_lm()
    engine = engine_for(model, mode)
    handle = HARMLESS[hook](model)
    try:
        with pytest.raises(UserError, match=r"after the privacy engine planned .* call engine\.replan\(\) instead"):
            engine.verify(make_batch, probe_loss)
        assert not engine.verified
        engine.replan(make_batch=make_batch, loss_fn=probe_loss)  # the plan now has the hook, and the proof too
        assert engine.verified
        engine.step(losses(model, token_ids()[:4]))
    finally:
        handle.remove()
    assert engine.steps == 1


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
@pytest.mark.parametrize("hook", list(HARMLESS))
def test_a_hook_registered_before_the_engine_is_proven_and_stepped(hook, mode):
    model = tiny_lm()
    handle = HARMLESS[hook](model)
    try:
        engine = engine_for(model, mode)
        engine.verify(make_batch, probe_loss)
        engine.step(losses(model, token_ids()[:4]))
    finally:
        handle.remove()
    assert engine.steps == 1


def proven_tiny_lm(mode: str) -> tuple:
    """(model, engine): a TinyLM in training mode and its engine, proven on the probe's plain batches."""
    torch.manual_seed(0)
    model = TinyLM().train()
    engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                           max_grad_norm=0.5, expected_batch_size=8, dataset_size=100, clipping_mode=mode,
                           probe_batch=lambda e, p, g: {"input_ids": torch.randint(0, 11, (e, p), generator=g)},
                           probe_loss=lambda m, b: losses(m, b["input_ids"]))
    engine.verify()
    return model, engine


class Mixing(torch.Tensor):
    """A tensor subclass in the training batch only (session-26 red team): at every linear layer it replaces each
    row's input by example 0's, unseen by any mode or hook."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and args[0].ndim == 3:
            with torch._C.DisableTorchFunctionSubclass():
                x = args[0].as_subclass(torch.Tensor)
                out = torch.nn.functional.linear(x[:1].expand_as(x) + 0 * x, *args[1:], **kwargs)
            return out.as_subclass(cls)
        return super().__torch_function__(func, types, args, kwargs)


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
def test_a_tensor_subclass_in_the_training_batch_is_refused_in_one_sentence(mode):
    model, engine = proven_tiny_lm(mode)
    ids = torch.randint(0, 11, (8, 6), generator=torch.Generator().manual_seed(1))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UserError, match="tensor subclass \\(Mixing\\)"):
        engine.step(losses(model, ids.as_subclass(Mixing)).as_subclass(torch.Tensor))
    assert all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))


class MixingWeight(nn.Parameter):
    """A parameter subclass whose ``__torch_function__`` mixes every row of a linear layer's input into example
    0's: the weight, not the batch, carries the foreign code."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and args[0].ndim == 3:
            with torch._C.DisableTorchFunctionSubclass():
                x = args[0]
                return torch.nn.functional.linear(x[:1].expand_as(x) + 0 * x, *args[1:], **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


@pytest.mark.parametrize("mode", ["bookkeeping", "per_sample"])
def test_a_tracked_weight_of_a_parameter_subclass_is_refused_in_one_sentence(mode):
    model, engine = proven_tiny_lm(mode)
    fc = model.blocks[1].fc
    fc.weight.__class__ = MixingWeight  # after the proof, as a quantisation or tracing library might wrap it
    ids = torch.randint(0, 11, (8, 6), generator=torch.Generator().manual_seed(1))
    with pytest.raises(UserError, match="weight is a tensor subclass \\(MixingWeight\\)"):
        engine.step(losses(model, ids))
