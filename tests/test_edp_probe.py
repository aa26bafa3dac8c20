"""eDP-SGD's start-up probe (``EDPEngine.verify``): per-slot clipping against brute-force autograd on synthetic
inputs, the loss's shape, and buffers that a training forward changes (state released without noise; the DP-SGD
probe refuses those too)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptext.errors import UserError
from dptext.privacy import PrivacyEngine
from dptext.privacy.mechanisms.edp import EDPEngine
from dptext.privacy.proof.synthetic import output_functional_loss

VOCAB, WIDTH = 11, 6


class Tiny(nn.Module):
    def __init__(self, norm: nn.Module | None = None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.norm = norm

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None):
        h = torch.tanh(self.fc(self.embed(input_ids)))
        return h if self.norm is None else self.norm(h.transpose(1, 2)).transpose(1, 2)


def engine_for(model, alphas=None):
    model = model.double()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    alphas = {p: a for p, a in zip([p for p in model.parameters() if p.requires_grad], alphas)} if alphas else None
    return EDPEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=0.05, sample_rate=0.5, dataset_size=10,
                     micro_batches_per_device=2, alphas=alphas, scaling="public" if alphas else "uniform")


@pytest.mark.parametrize("alphas", [None, (0.5, 2.0, 3.0)])
def test_the_probe_accepts_exact_slot_clipping(alphas):
    engine = engine_for(Tiny(), alphas)
    engine.verify()
    assert engine.verified
    assert all(p.grad is None for p in engine.params) and not engine.clipped_grads()  # leaves nothing behind


def test_a_hook_that_rewrites_a_gradient_is_refused_naming_the_parameter():
    model = Tiny()
    engine = engine_for(model)

    def scale_gradient(param):  # after accumulation: autograd.grad (the reference) never sees it
        param.grad.mul_(10.0)

    model.fc.weight.register_post_accumulate_grad_hook(scale_gradient)
    with pytest.raises(UserError, match=r"refused parameter 'fc\.weight'"):
        engine.verify()


def test_running_statistics_updated_by_the_forward_are_refused():
    norm = nn.BatchNorm1d(WIDTH)
    norm.requires_grad_(False)  # frozen, but its running statistics still follow the private batches
    engine = engine_for(Tiny(norm))
    with pytest.raises(UserError, match=r"refused buffer 'norm\.running_mean'"):
        engine.verify()


def test_a_loss_without_one_entry_per_example_is_refused():
    engine = engine_for(Tiny())
    with pytest.raises(UserError, match="one loss per example"):
        engine.verify(loss_fn=lambda model, batch: output_functional_loss(model, batch).sum())


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
def test_dp_sgd_probe_also_refuses_running_statistics_of_a_frozen_layer(mode):
    norm = nn.BatchNorm1d(WIDTH)
    norm.requires_grad_(False)  # no parameter to clip, but the buffers follow the private batches
    model = Tiny(norm).double()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    engine = PrivacyEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=0.05, expected_batch_size=4,
                           dataset_size=100, clipping_mode=mode)
    with pytest.raises(UserError, match=r"refused buffer 'norm\.running_mean'.*without noise"):
        engine.verify()


def training_batch(model) -> dict:
    ids = torch.randint(1, VOCAB, (4, 5), generator=torch.Generator().manual_seed(7))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_the_probe_runs_by_default_before_the_first_training_forward():
    """Issue 43: EDPEngine proves by default as PrivacyEngine does; no verify() call is needed, and a model the
    probe refuses is refused at the first training forward, before any private example goes through it."""
    model = Tiny()
    engine = engine_for(model)
    assert not engine.verified and engine.mechanism()["clipping_verified"] is False
    with torch.no_grad():  # an evaluation forward proves nothing and is not held up
        output_functional_loss(model, training_batch(model))
    assert not engine.verified
    engine.accumulate(output_functional_loss(model, training_batch(model)))
    engine.close_unit()
    assert engine.verified and engine.mechanism()["clipping_verified"] is True
    refused = Tiny()
    refused_engine = engine_for(refused)

    def scale_gradient(param):  # as in test_a_hook_that_rewrites_a_gradient_is_refused_naming_the_parameter
        param.grad.mul_(10.0)
    refused.fc.weight.register_post_accumulate_grad_hook(scale_gradient)
    with pytest.raises(UserError, match=r"refused parameter 'fc\.weight'"):
        output_functional_loss(refused, training_batch(refused))
    assert not refused_engine.verified


def test_opting_out_is_recorded_in_the_mechanism():
    model = Tiny().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = EDPEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=0.05, sample_rate=0.5, dataset_size=10,
                       verify=False)
    engine.accumulate(output_functional_loss(model, training_batch(model)))
    assert not engine.verified
    assert "NOT VERIFIED" in engine.mechanism()["clipping"] and "verify=False" in engine.mechanism()["clipping"]
