"""A ``TorchFunctionMode`` or ``TorchDispatchMode`` active around the engine's own calls (``accumulate``, ``step``,
eDP-SGD's ``close_unit``), not the forward, is refused in one sentence before the call does anything
(``call_checks.refuse_mode_around``): no call check sees it, and it can scale the backward's gradients, undo the
clipping or make the noise a public function of the shapes. Each case is shown to change the step silently with
the check taken out. ``torch.device(...)`` is accepted. eDP-SGD's forward needs no call check (the last tests)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from fsdp_models import losses, tiny_lm, token_ids

from dptext.errors import UserError
from dptext.privacy import PrivacyEngine
from dptext.privacy import engine as engine_module
from dptext.privacy.mechanisms import edp as edp_module
from dptext.privacy.mechanisms.edp import EDPEngine
from dptext.privacy.proof import step_checks

RANDOM_OPS = ("randint", "normal", "randn")


class ScaledSeed(TorchDispatchMode):
    """The backward pass's seed gradient (``ones_like`` of the summed loss) times 1.5: every gradient 1.5x."""

    def __init__(self):
        super().__init__()
        self.hits = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.ones_like.default and out.ndim == 0:
            self.hits += 1
            return out * 1.5
        return out


class ScaledLossSumFunction(TorchFunctionMode):
    """The same from a function mode (``Tensor.sum``)."""

    def __init__(self):
        super().__init__()
        self.hits, self.loss = 0, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") == "sum" and args[0] is self.loss:
            self.hits += 1
            return out * 1.5
        return out


class ZeroRandom(TorchDispatchMode):
    """Zeroes what random ops draw on this thread: the noise's chunk seeds (``randint``), so the noise no longer
    depends on the engine's secret root; ``sqrt`` too (``zero_norms``): eDP-SGD's unit norm, so no unit is clipped."""

    def __init__(self, zero_norms: bool = False):
        super().__init__()
        self.hits, self.zero_norms = 0, zero_norms

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if any(op in name for op in RANDOM_OPS) or (self.zero_norms and name == "sqrt"):
            self.hits += 1
            return torch.zeros_like(out)
        return out


class ZeroRandomFunction(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.hits = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(op in getattr(func, "__name__", "") for op in RANDOM_OPS):
            self.hits += 1
            return torch.zeros_like(out)
        return out


def engine_for(model, seed=0, noise=0.0, mode="bookkeeping"):
    return PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=noise,
                         max_grad_norm=1e6, expected_batch_size=4, dataset_size=12, clipping_mode=mode, seed=seed,
                         verify=False)


def moves(engine, around_accumulate=nullcontext(), around_step=nullcontext()):
    model = engine.model
    before = [p.detach().clone() for p in model.parameters()]
    loss = losses(model, token_ids()[:4])
    if hasattr(around_accumulate, "loss"):
        around_accumulate.loss = loss
    with around_accumulate:
        engine.accumulate(loss)
    with around_step:
        engine.step()
    return [p.detach() - b for p, b in zip(model.parameters(), before)]


def unchecked(monkeypatch):
    for module in (step_checks, engine_module, edp_module):
        monkeypatch.setattr(module, "refuse_mode_around", lambda call: None, raising=False)


GRADIENT_MODES = {"dispatch": ScaledSeed, "function": ScaledLossSumFunction}
NOISE_MODES = {"dispatch": ZeroRandom, "function": ZeroRandomFunction}


@pytest.mark.parametrize("clipping", ["bookkeeping", "ghost", "per_sample"])
@pytest.mark.parametrize("kind", list(GRADIENT_MODES))
def test_a_mode_around_accumulate_is_refused(kind, clipping):
    engine = engine_for(tiny_lm(), mode=clipping)
    loss = losses(engine.model, token_ids()[:4])
    mode = GRADIENT_MODES[kind]()
    mode.loss = loss
    with mode, pytest.raises(UserError, match=r"^engine\.accumulate\(\) was called inside a Torch"
                                                                 rf"{kind.capitalize()}Mode \(Scaled") as error:
        engine.accumulate(loss)
    assert error.value.args[0].count(". ") == 0 and not engine.clipped_grads()


@pytest.mark.parametrize("kind", list(GRADIENT_MODES))
def test_a_mode_around_accumulate_scales_the_step_silently_without_the_check(kind, monkeypatch):
    unchecked(monkeypatch)
    plain = moves(engine_for(tiny_lm()))
    mode = GRADIENT_MODES[kind]()
    scaled = moves(engine_for(tiny_lm()), around_accumulate=mode)
    assert mode.hits == 1
    for got, expected in zip(scaled, plain):  # C is far above every norm: nothing is clipped, all 1.5x
        torch.testing.assert_close(got, 1.5 * expected)


@pytest.mark.parametrize("kind", list(NOISE_MODES))
def test_a_mode_around_step_is_refused(kind):
    engine = engine_for(tiny_lm(), noise=1.0)
    engine.accumulate(losses(engine.model, token_ids()[:4]))
    with NOISE_MODES[kind](), pytest.raises(UserError, match=r"^engine\.step\(\) was called inside a Torch"):
        engine.step()
    assert engine.steps == 0
    engine.step()  # outside the mode
    assert engine.steps == 1


@pytest.mark.parametrize("kind", list(NOISE_MODES))
def test_a_mode_around_step_makes_the_noise_public_silently_without_the_check(kind, monkeypatch):
    # two engines with different secret roots draw the same noise under the mode: it depends on the shapes only
    unchecked(monkeypatch)
    secret = [moves(engine_for(tiny_lm(), seed=seed, noise=1.0)) for seed in (1, 2)]
    assert not torch.allclose(secret[0][0], secret[1][0])
    modes = [NOISE_MODES[kind]() for _ in range(2)]
    public = [moves(engine_for(tiny_lm(), seed=seed, noise=1.0), around_step=mode)
              for seed, mode in zip((1, 2), modes)]
    assert all(mode.hits for mode in modes)
    for first, second in zip(*public):
        torch.testing.assert_close(first, second)


def test_a_device_context_around_the_engine_calls_is_accepted():
    engine = engine_for(tiny_lm())
    with torch.device("cpu"):
        moves(engine, around_accumulate=torch.device("cpu"), around_step=torch.device("cpu"))
    assert engine.steps == 1


# ------------------------------------------------------------------ eDP-SGD


def edp_for(model, seed=0, noise=2.0, max_grad_norm=1e-3):
    return EDPEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=noise,
                     max_grad_norm=max_grad_norm, sample_rate=0.5, dataset_size=12, seed=seed, verify=False)


def edp_unit(engine, around_accumulate=nullcontext(), around_close=nullcontext()):
    loss = losses(engine.model, token_ids()[:4])
    with around_accumulate:
        engine.accumulate(loss)
    with around_close:
        return engine.close_unit()


@pytest.mark.parametrize("call", ["accumulate", "close_unit", "step"])
def test_edp_refuses_a_mode_around_its_calls(call):
    engine = edp_for(tiny_lm())
    mode = ZeroRandom(zero_norms=True)
    with pytest.raises(UserError, match=rf"^engine\.{call}\(\) was called inside a TorchDispatchMode \(ZeroRandom"):
        if call == "accumulate":
            edp_unit(engine, around_accumulate=mode)
        elif call == "close_unit":
            edp_unit(engine, around_close=mode)
        else:
            edp_unit(engine)
            with mode:
                engine.step()
    assert engine.steps == 0


def test_edp_a_mode_around_close_unit_undoes_the_clipping_silently_without_the_check(monkeypatch):
    unchecked(monkeypatch)
    engine = edp_for(tiny_lm(), noise=2.0)
    edp_unit(engine)
    clipped = torch.sqrt(sum(g.pow(2).sum() for g in engine.clipped_grads().values()))
    engine.zero_grad()
    edp_unit(engine, around_close=ZeroRandom(zero_norms=True))
    unclipped = torch.sqrt(sum(g.pow(2).sum() for g in engine.clipped_grads().values()))
    assert clipped <= 1e-3 * (1 + 1e-4) and unclipped > 100 * 1e-3  # the unit joined far above C


def test_edp_a_mode_around_step_makes_the_noise_public_silently_without_the_check(monkeypatch):
    unchecked(monkeypatch)
    updates = []
    for seed in (1, 2):
        engine = edp_for(tiny_lm(), seed=seed)
        before = [p.detach().clone() for p in engine.model.parameters()]
        edp_unit(engine)
        with ZeroRandom():
            engine.step()
        updates.append([p.detach() - b for p, b in zip(engine.model.parameters(), before)])
    for first, second in zip(*updates):
        torch.testing.assert_close(first, second)


def second_use(module, args, output):
    return output + 0.5 * nn.functional.linear(args[0], module.weight)


class ScaledProducts(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 1.5 if func in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default) else out


def forward_with(model, around):
    handle = model.blocks[1].fc.register_forward_hook(second_use) if around == "hook_around_forward" else None
    with ScaledProducts() if around == "dispatch_mode_around_forward" else nullcontext():
        loss = losses(model, token_ids()[:4])
    if handle is not None:
        handle.remove()
    return loss


@pytest.mark.parametrize("around", ["hook_after_construction", "hook_around_forward", "dispatch_mode_around_forward"])
def test_edp_forward_code_leaves_every_unit_clipped_to_c(around):
    # eDP-SGD has no per-layer rule a forward could fool: each unit's gradient is plain autograd's over whatever
    # ran (hooks and modes included) and is clipped as one vector, so a unit moves the sum by at most C whatever
    # code ran in its forward; the DP-SGD call checks guard rules it does not have
    model = tiny_lm()
    engine = edp_for(model, noise=2.0, max_grad_norm=1e-3)
    if around == "hook_after_construction":
        model.blocks[1].fc.register_forward_hook(second_use)
    grads = torch.autograd.grad(forward_with(model, around).float().sum(), engine.params)
    mean = [g.float() / 4 for g in grads]
    norm = float(torch.sqrt(sum(g.pow(2).sum() for g in mean)))
    engine.accumulate(forward_with(model, around))
    engine.close_unit()
    got = engine.clipped_grads()
    assert norm > 1e-3  # the unit was clipped
    for param, grad in zip(engine.params, mean):
        torch.testing.assert_close(got[param], grad * 1e-3 / norm, rtol=1e-4, atol=1e-9)
