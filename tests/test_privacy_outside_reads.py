"""A tracked weight read outside its module (issue 14, pattern 3), at every step and without the probe.

Ghost mode: the structural check (``dptext.privacy.proof.outside_reads``) stops the step before any backward pass,
naming the parameter, and accepts the same model when the read goes through the owning module (exact against
brute-force per-example autograd). Book-keeping and per_sample: the read gets no gradient (a dropped path); the
clipped sums then equal brute force on the model with that read detached, and removing one example moves them
by at most C — so it is no leak, and the start-up probe refuses it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptext.errors import UserError
from dptext.privacy import PrivacyEngine

VOCAB, WIDTH, CLIP = 11, 6, 0.05


class Head(nn.Module):
    """Owns no parameter: reads the embedding's weight through a reference (a second module reading it)."""

    def __init__(self, source: nn.Embedding):
        super().__init__()
        self.source = [source]  # a list: not a submodule, so the weight has one owner

    def forward(self, h):
        return F.linear(h, self.source[0].weight)


class Model(nn.Module):
    def __init__(self, read: str, detach: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.head = Head(self.embed)
        self.read, self.detach = read, detach

    def forward(self, input_ids):
        h = torch.tanh(self.fc(self.embed(input_ids)))
        weight = self.embed.weight.detach() if self.detach else self.embed.weight
        if self.read == "functional":
            return F.linear(h, weight)
        if self.read == "second_module":
            return self.head(h) if not self.detach else F.linear(h, weight)
        if self.read == "after_owner":  # the owner casts the weight first; under autocast the read reuses that cast
            return F.linear(self.fc(h), self.fc.weight)
        return self.embed(input_ids) + h  # through the owning module only


def losses(model, ids):
    out = model(ids)
    weights = torch.randn(out.shape[1:], generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    return (out * weights).sum(dim=(1, 2))


def batch(rows=4, positions=5, seed=0):
    return torch.randint(0, VOCAB, (rows, positions), generator=torch.Generator().manual_seed(seed))


def engine_for(model, mode):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    return PrivacyEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=CLIP, expected_batch_size=4,
                         dataset_size=100, clipping_mode=mode, verify=False), optimizer


def brute_force_sums(model, ids):
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [torch.autograd.grad(losses(model, ids[i:i + 1]).sum(), params, allow_unused=True) for i in range(len(ids))]
    rows = [[torch.zeros_like(p) if g is None else g for g, p in zip(row, params)] for row in rows]
    norms = [float(sum(g.pow(2).sum() for g in row).sqrt()) for row in rows]
    coef = [min(1.0, CLIP / (n + 1e-6)) for n in norms]
    return {p: sum(c * row[k] for c, row in zip(coef, rows)) for k, p in enumerate(params)}


@pytest.mark.parametrize("read", ["functional", "second_module"])
def test_ghost_stops_an_outside_read_at_every_step_naming_the_parameter(read):
    torch.manual_seed(0)
    model = Model(read).double()
    engine, optimizer = engine_for(model, "ghost")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(UserError, match=r"Parameter 'embed\.weight' is read outside the layers that own it"):
        engine.step(losses(model, batch()))
    assert not engine.clipped_grads()
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())  # no update
    assert all(p.grad is None for p in model.parameters())  # not even a first backward pass


def test_ghost_sees_an_outside_read_through_autocasts_cached_cast():
    torch.manual_seed(0)
    model = Model("after_owner")
    engine, _ = engine_for(model, "ghost")
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            pytest.raises(UserError, match=r"Parameter 'fc\.weight' is read outside"):
        engine.accumulate(losses(model, batch()).float())
    assert not engine.clipped_grads()


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
def test_reads_through_the_owning_module_pass_and_are_exact(mode):
    torch.manual_seed(0)
    model = Model("owner").double()
    reference = brute_force_sums(model, batch())
    engine, _ = engine_for(model, mode)
    for _ in range(2):  # the check keeps working step after step
        engine.zero_grad()
        engine.accumulate(losses(model, batch()))
    got = engine.clipped_grads()
    for param, expected in reference.items():
        torch.testing.assert_close(got[param].double(), expected, rtol=1e-5, atol=1e-8)  # sums are fp32


@pytest.mark.parametrize("mode", ["bookkeeping", "per_sample"])
@pytest.mark.parametrize("read", ["functional", "second_module"])
def test_without_autograd_the_outside_read_is_a_dropped_path_not_a_leak(read, mode):
    torch.manual_seed(0)
    model = Model(read).double()
    detached = Model(read, detach=True).double()
    detached.load_state_dict(model.state_dict())
    ids = batch()
    reference = brute_force_sums(detached, ids)  # the model without the outside path
    engine, _ = engine_for(model, mode)
    engine.accumulate(losses(model, ids))
    full = engine.clipped_grads()
    for param_model, param_ref in zip(model.parameters(), detached.parameters()):
        torch.testing.assert_close(full[param_model].double(), reference[param_ref], rtol=1e-5, atol=1e-8)
    for j in range(len(ids)):  # removing one example moves the clipped sum by at most C
        engine.zero_grad()
        engine.accumulate(losses(model, torch.cat([ids[:j], ids[j + 1:]])))
        rest = engine.clipped_grads()
        moved = sum(float((full[p] - rest[p]).pow(2).sum()) for p in full) ** 0.5
        assert moved <= CLIP * (1 + 1e-6)  # fp32 sums
    engine.zero_grad()
    with pytest.raises(UserError, match="'embed'"):
        engine.verify(make_batch=lambda b, t, g: {"input_ids": torch.randint(0, VOCAB, (b, t), generator=g)},
                      loss_fn=lambda m, x: losses(m, x["input_ids"]))

