"""The plan follows the model (issue 43): a layer frozen, a dtype converted or parameters re-created after the
privacy engine was built are seen at the next step, in every clipping mode, and refused before the update until
``engine.replan()``; after it the frozen layer is neither noised nor updated and the accounting is unchanged.
Through the public API, on tiny models built in code.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from dptext.accounting import StepRun, compute_epsilon
from dptext.errors import UserError
from dptext.models import load_model
from dptext.privacy import PrivacyEngine, causal_lm_loss

MODES = ["bookkeeping", "ghost", "per_sample"]


@functools.lru_cache(maxsize=1)
def _tiny_llama():
    return load_model("tiny-llama", head="causal_lm")[0]


def tiny_llama():
    model = copy.deepcopy(_tiny_llama())  # built once: each test trains its own copy
    model.train()
    return model


def engine_for(model, mode, sigma=0.0, verify=False):
    """Unproven unless asked (the probe is tested elsewhere; these tests are about the step's checks)."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    return PrivacyEngine(model, optimizer, noise_multiplier=sigma, max_grad_norm=1.0, expected_batch_size=2,
                         dataset_size=100, clipping_mode=mode, seed=3, verify=verify)


def loss(model, examples=2, length=6):
    ids = torch.randint(1, 200, (examples, length), generator=torch.Generator().manual_seed(examples + length))
    mask = torch.ones_like(ids)
    return causal_lm_loss(model(input_ids=ids, attention_mask=mask).logits, ids, mask)


def snapshot(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def unchanged(model, before, prefix=""):
    return all(torch.equal(before[name], p) for name, p in model.named_parameters() if name.startswith(prefix))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["method", "attribute"])
def test_a_layer_frozen_after_the_engine_is_refused_then_left_alone_after_replan(mode, how):
    model = tiny_llama()
    engine = engine_for(model, mode, sigma=1.0)
    frozen = model.model.layers[0].mlp
    if how == "method":
        frozen.requires_grad_(False)
    else:
        for param in frozen.parameters():
            param.requires_grad = False
    before = snapshot(model)
    with pytest.raises(UserError, match="was frozen after the privacy engine planned"):
        engine.step(loss(model))
    assert unchanged(model, before) and engine.steps == 0  # nothing applied, nothing accounted
    engine.replan(verify=False)
    assert not any(p.requires_grad for p in frozen.parameters())  # replan keeps the user's choice
    engine.step(loss(model))  # σ = 1: a noisy step
    assert unchanged(model, before, "model.layers.0.mlp.")  # neither noised nor updated
    assert not unchanged(model, before, "model.layers.0.self_attn.")
    assert engine.steps == 1
    expected = compute_epsilon("rdp", [StepRun(engine.sample_rate, 1.0, 1)], 1e-5)
    assert engine.epsilon(1e-5) == expected.guaranteed


@pytest.mark.parametrize("mode", ["bookkeeping", "per_sample"])
def test_freezing_an_already_frozen_layer_or_the_probe_switching_flags_is_not_a_freeze(mode):
    model = tiny_llama()
    model.model.layers[1].requires_grad_(False)  # before the engine: simply not planned
    engine = engine_for(model, mode, verify=True)
    model.model.layers[1].requires_grad_(False)  # not planned, so not the engine's
    engine.step(loss(model))  # the first forward runs the probe, which switches the planned flags on and off
    assert engine.verified and engine.steps == 1


@pytest.mark.parametrize("mode", MODES)
def test_a_dtype_conversion_after_the_engine_is_refused_then_exact_after_replan(mode):
    model = tiny_llama()
    engine = engine_for(model, mode)
    model.double()  # converts in place: the same Parameter objects, now fp64
    before = snapshot(model)
    with pytest.raises(UserError, match="changed dtype from torch.float32 to torch.float64"):
        engine.step(loss(model))
    assert unchanged(model, before) and engine.steps == 0
    engine.replan(verify=False)
    per_example = loss(model)
    engine.accumulate(per_example)
    got = {p: s.double() for p, s in engine.clipped_grads().items()}
    want = brute_force_clipped_sum(model, engine.params, 1.0)
    assert all(torch.allclose(got[p], want[p], rtol=1e-5, atol=1e-6) for p in engine.params)
    engine.step()
    assert engine.steps == 1


def brute_force_clipped_sum(model, params, clip):
    """Σ_i min(1, C/‖g_i‖)·g_i with plain per-example autograd on a copy without the engine's hooks."""
    reference = copy.deepcopy(model)
    reference._forward_pre_hooks.clear()
    for module in reference.modules():
        module._forward_hooks.clear()
        module._forward_pre_hooks.clear()
    names = [name for name, p in model.named_parameters() if any(p is q for q in params)]
    ref_params = [reference.get_parameter(name) for name in names]
    for p in reference.parameters():
        p.requires_grad_(False)
    for p in ref_params:
        p.requires_grad_(True)
    per_example = loss(reference)
    total = [torch.zeros_like(p) for p in ref_params]
    for i in range(len(per_example)):
        grads = torch.autograd.grad(per_example[i], ref_params, retain_graph=True)
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
        factor = min(1.0, clip / float(norm))
        total = [t + factor * g for t, g in zip(total, grads)]
    return {p: t for p, t in zip((model.get_parameter(n) for n in names), total)}


@pytest.mark.parametrize("mode", MODES)
def test_load_state_dict_with_assign_is_refused_and_replan_trains_the_new_parameters(mode):
    model = tiny_llama()
    engine = engine_for(model, mode)
    trained = {name for name, p in model.named_parameters() if any(p is q for q in engine.params)}
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    with pytest.raises(UserError, match="no longer in the model"):
        engine.step(loss(model))
    assert engine.steps == 0
    optimizer = engine.optimizer
    optimizer.param_groups[0]["params"] = list(model.parameters())  # the user points the optimizer at the new ones
    engine.replan(verify=False)
    planned = {name for name, p in model.named_parameters() if any(p is q for q in engine.params)}
    assert planned == {name for name, _ in model.named_parameters()} and trained <= planned  # (assign unties)
    before = snapshot(model)
    engine.step(loss(model))
    assert not unchanged(model, before) and engine.steps == 1


def test_detach_gives_back_plain_parameters_and_keeps_a_freeze():
    model = tiny_llama()
    engine = engine_for(model, "bookkeeping")
    assert all(type(p) is not nn.Parameter for p in engine.params)  # noqa: E721 (the engine's own class)
    model.model.layers[0].requires_grad_(False)
    engine.detach()
    assert all(type(p) is nn.Parameter for p in model.parameters())  # noqa: E721
    assert not any(p.requires_grad for p in model.model.layers[0].parameters())
    assert all(p.requires_grad for p in model.model.layers[1].parameters())
    assert all(type(p) is nn.Parameter for p in copy.deepcopy(model).parameters())  # noqa: E721
