"""The probe's stack (issue 42): the first probe shape on the whole model, the second on each block stack cut
after its last block that differs, with one hooked forward of the whole model (``dptext.privacy.proof.stack``).

Blocks equal in class, settings, parameters and without per-instance code share their first instance's verdict;
a block with a hook is kept; examples mixed by the parent's loop at a depth the cut leaves out, in the forward (with
or without gradient) or only in the backward, are still refused (the whole model's first shape); a forward that does
not run on the cut stack is proven whole.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptext.errors import UserError
from dptext.models import load_model
from dptext.privacy import PrivacyEngine
from dptext.privacy.proof import verify as verify_module
from dptext.privacy.proof.patterns import representatives
from dptext.privacy.proof.stack import plan_cut
from test_proof_patterns import MixRows as MixBelow  # identity forward, a backward that mixes examples


def engine_for(model, mode="bookkeeping"):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return PrivacyEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=0.05, expected_batch_size=4,
                         dataset_size=100, clipping_mode=mode)


def cut_of(model, engine):
    hooks = verify_module.engine_hooks(engine)
    return plan_cut(model, engine.tracked, representatives(model, engine.tracked, engine.names, hooks), hooks)


def tiny_llama(layers=3):
    model = load_model("tiny-llama", head="causal_lm")[0]
    model.model.layers.extend(type(model.model.layers[0])(model.config, i) for i in range(2, layers))
    model.config.num_hidden_layers = layers
    return model.train()


def test_a_decoder_keeps_its_first_block_and_the_others_share_its_verdict():
    model = tiny_llama(3)
    engine = engine_for(model)
    cut = cut_of(model, engine)
    assert [(attribute, kept) for _, attribute, _, kept in cut.stacks] == [("layers", 1)]
    assert model.model.layers[2].mlp.down_proj in cut.dropped
    report = engine.verify()
    assert {row.status for row in report.rows.values()} == {"exact"}
    assert len(model.model.layers) == 3  # restored


def test_a_block_with_a_hook_is_kept_and_a_problem_in_it_is_refused():
    model = tiny_llama(3)
    target = model.model.layers[2].mlp.down_proj
    target.register_forward_hook(lambda module, args, output: output.roll(1, dims=0))  # mixes examples
    engine = engine_for(model)
    assert cut_of(model, engine) is None  # the last block differs from every block before it
    with pytest.raises(UserError, match="refused"):
        engine.verify()


class DeepStack(nn.Module):
    """Embedding → three equal blocks; ``mix_at`` mixes examples after that block in the parent's loop (in the
    forward with a batch mean, or only in the backward with ``MixBelow``); ``assert_depth`` fails on a cut stack."""

    def __init__(self, mix_at=None, backward_only=False, assert_depth=False, vocab=13, width=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.head = nn.Linear(width, vocab)
        self.mix_at, self.backward_only, self.assert_depth = mix_at, backward_only, assert_depth

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None):
        if self.assert_depth and len(self.layers) != 3:
            raise IndexError("this model wants its three layers")
        h = self.embed(input_ids)
        for index, layer in enumerate(self.layers):
            h = torch.tanh(layer(h))
            if index == self.mix_at:
                h = MixBelow.apply(h) if self.backward_only else h + h.mean(dim=0, keepdim=True)
        return self.head(h)


@pytest.mark.parametrize("backward_only", [False, True])
def test_examples_mixed_by_the_parent_below_the_cut_are_refused(backward_only):
    model = DeepStack(mix_at=1, backward_only=backward_only).double()
    engine = engine_for(model)
    assert cut_of(model, engine) is not None
    with pytest.raises(UserError, match="refused"):
        engine.verify()
    refused = {row.name for row in verify_module.probe(engine, cut_stacks=True).refused()}
    assert "embed" in refused  # the mix reaches the layers below it


class Mixed(nn.Module):
    """Embedding → three equal blocks, ``mix(h, attention_mask, index, blocks)`` in the parent's loop after each."""

    def __init__(self, mix, vocab=13, width=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.head = nn.Linear(width, vocab)
        self.mix = mix

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        for index, layer in enumerate(self.layers):
            h = self.mix(torch.tanh(layer(h)), attention_mask, index, len(self.layers))
        return self.head(h)


def _mean_of_the_uncompared(h, mask, index, blocks):
    """At depth 1, with gradient, among examples 2.. only: the probe's engine pass weights their losses by 0."""
    return torch.cat([h[:2], h[2:] + h[2:].mean(0, keepdim=True)]) if index == 1 else h


def _chain_of_full_rows(h, mask, index, blocks):
    """At depth 1, with gradient: each full-length example adds the previous full-length one's row."""
    if index != 1 or mask is None:
        return h
    full, rows = (mask.sum(1) == mask.shape[1]).nonzero().flatten().tolist(), list(h.unbind(0))
    for a, b in zip(full, full[1:]):
        rows[b] = rows[b] + h[a]
    return torch.stack(rows)


def _detached_mean_at_full_depth(h, mask, index, blocks):
    """After the last block, only while all three exist, without gradient."""
    return h + h.mean(0, keepdim=True).detach() if index == blocks - 1 == 2 else h


def _detached_mean_for_odd_batches(h, mask, index, blocks):
    """In the kept block, without gradient, only when the batch has an odd number of examples (B = 5, not 4)."""
    return h + h.mean(0, keepdim=True).detach() if index == 0 and h.shape[0] % 2 else h


@pytest.mark.parametrize("mix", [_mean_of_the_uncompared, _chain_of_full_rows, _detached_mean_at_full_depth,
                                 _detached_mean_for_odd_batches])
@pytest.mark.parametrize("cut_stacks", [True, False])
def test_examples_mixed_where_only_the_first_shapes_whole_model_redraws_see_it_are_refused(mix, cut_stacks):
    """The red team of session 23: mixes the engine's pass cannot see (no gradient, or only into the examples whose
    losses it weights by 0) at a depth the cut removes are refused by the first shape's re-draws on the whole model;
    one seen only at B ≠ T stays refused after the second shape (its loss check once cleared the first's finding)."""
    model = Mixed(mix).double()
    engine = engine_for(model)
    assert cut_of(model, engine) is not None
    report = verify_module.probe(engine, cut_stacks=cut_stacks)
    assert report.loss_problem and "interact" in report.loss_problem
    with pytest.raises(UserError, match="interact"):
        report.raise_if_refused()


def test_the_same_stack_without_a_mix_is_proven():
    model = Mixed(lambda h, mask, index, blocks: h).double()
    report = engine_for(model).verify()
    assert {row.status for row in report.rows.values()} == {"exact"}


def test_a_forward_that_fails_on_the_cut_stack_is_proven_whole():
    model = DeepStack(assert_depth=True).double()
    engine = engine_for(model)
    report = engine.verify()
    assert any("proved the whole stack" in note for note in report.notes)
    assert {row.status for row in report.rows.values()} == {"exact"}


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
def test_the_cut_and_the_whole_stack_agree_on_a_mixing_block_class(mode):
    """Every block's own code mixes examples in the backward (the class's): refused with or without the cut."""
    class Mixing(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)

        def forward(self, x):
            return MixBelow.apply(self.fc(x))

    model = DeepStack().double()
    model.layers = nn.ModuleList(Mixing().double() for _ in range(3))
    for cut in (True, False):
        engine = engine_for(model, mode)
        refused = {row.name for row in verify_module.probe(engine, cut_stacks=cut).refused()}
        assert {"layers.0.fc", "layers.2.fc"} <= refused, (cut, refused)
        engine.detach()
