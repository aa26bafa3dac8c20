"""Paths that crashed with a torch traceback (issue 43) now give the exact clipped sums or one sentence:
checked against brute-force per-example autograd (``arch_cases``), on tiny fp64 models built in code.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from arch_cases import (BY_NAME, SITUATIONS, Situation, _arch, build, compare, engine_result, make_batch, prepare,
                        run_cell)
from arch_cases import brute_force as loop_brute_force
from dptext.errors import UserError
from dptext.privacy import PrivacyEngine
from test_privacy_engine import brute_force

MODES = ["bookkeeping", "ghost", "per_sample"]
CLIP = 0.05
SITUATIONS["one_example"] = Situation("one_example", batch=1)
CTRL = _arch("ctrl", "ctrl", "CTRLLMHeadModel", n_embd=16, n_layer=2, n_head=2, dff=32, n_positions=64)
UMT5 = _arch("umt5", "umt5", "UMT5ForConditionalGeneration", "encoder-decoder", d_model=16, d_ff=32, d_kv=8,
             num_layers=2, num_heads=2, relative_attention_num_buckets=8, decoder_start_token_id=0)
DEBERTA_V1 = _arch("deberta", "deberta", "DebertaForMaskedLM", "encoder", relative_attention=True,
                   pos_att_type=["p2c", "c2p"], max_relative_positions=16)


@pytest.mark.parametrize("mode", MODES)
def test_ctrl_scales_its_embeddings_in_place_and_is_exact(mode):
    """CTRL's ``inputs_embeds *= sqrt(d)`` hit the leaf the engine made of the embedding's output."""
    assert run_cell(CTRL, mode) == "exact"


@pytest.mark.parametrize("situation", ["single_token", "batch_eq_length", "default"])
@pytest.mark.parametrize("mode", MODES)
def test_umt5_relative_bias_of_every_layer_is_exact(mode, situation):
    """UMT5's per-layer bias tables: their (q, k) bucket ids were taken for rows (a crash at T = 1)."""
    assert run_cell(UMT5, mode, situation=situation) == "exact"


def test_deberta_v1_per_sample_with_one_example_is_one_sentence():
    outcome = run_cell(DEBERTA_V1, "per_sample", situation="one_example")
    assert outcome.startswith("refused: Layer 'deberta.encoder.layer.0.attention.self' (DisentangledSelfAttention)")
    assert "freeze its own parameters (q_bias, v_bias)" in outcome and outcome.count(". ") == 0


class Tiny(nn.Module):
    """Embedding → Linear (optionally under activation checkpointing) → tanh → Linear, one loss per example."""

    def __init__(self, reentrant: bool | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.fc, self.out = nn.Embedding(17, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.reentrant = reentrant
        self.double()

    def forward(self, input_ids):
        h = self.embed(input_ids)
        h = self.fc(h) if self.reentrant is None else checkpoint(self.fc, h, use_reentrant=self.reentrant)
        return self.out(torch.tanh(h)).sum(dim=(1, 2))


def engine_for(model, mode):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return PrivacyEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=CLIP, expected_batch_size=2,
                         dataset_size=10, clipping_mode=mode, verify=False)


IDS = torch.randint(0, 17, (3, 5), generator=torch.Generator().manual_seed(1))


def brute_force_of(model):
    reference = copy.deepcopy(model)
    return brute_force(reference, lambda rows: reference(IDS[rows]), 3, CLIP)


@pytest.mark.parametrize("mode", MODES)
def test_a_micro_batch_of_zero_rows_through_an_embedding_adds_nothing(mode):
    model = Tiny()
    expected_norms, expected = brute_force_of(model)
    engine = engine_for(model, mode)
    norms = engine.accumulate(model(torch.zeros(0, 5, dtype=torch.long)))
    assert norms.numel() == 0 and not engine.clipped_grads()
    got_norms = engine.accumulate(model(IDS))  # the logical batch goes on as if the empty one was not there
    got = {name: engine.clipped_grads()[p] for name, p in model.named_parameters()}
    assert compare(expected_norms, expected, got_norms, got) == []
    engine.step()
    assert engine.steps == 1


@pytest.mark.parametrize("mode", MODES)
def test_accumulating_the_same_loss_twice_is_one_sentence(mode):
    model = Tiny()
    engine = engine_for(model, mode)
    loss = model(IDS)
    engine.accumulate(loss)
    first = {p: s.clone() for p, s in engine.clipped_grads().items()}
    with pytest.raises(UserError, match="passed to accumulate\\(\\) already"):
        engine.accumulate(loss)
    with pytest.raises(UserError, match="passed to accumulate\\(\\) already"):  # ghost: or checkpointed
        engine.accumulate(loss[:2])  # a part of it: its graph is freed too
    assert all(torch.equal(first[p], s) for p, s in engine.clipped_grads().items())  # the first one stands


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("mode", ["bookkeeping", "per_sample"])
def test_activation_checkpointing_is_exact_in_bookkeeping_and_per_sample(mode, reentrant):
    model = Tiny(reentrant=reentrant)  # the same weights as Tiny()
    model.train()
    expected_norms, expected = brute_force_of(Tiny())  # torch.autograd.grad refuses reentrant checkpoints
    engine = engine_for(model, mode)
    got_norms = engine.accumulate(model(IDS))
    got = {name: engine.clipped_grads()[p] for name, p in model.named_parameters()}
    assert compare(expected_norms, expected, got_norms, got) == []


def test_ghost_with_reentrant_checkpointing_is_one_sentence_and_non_reentrant_is_exact():
    model = Tiny(reentrant=True)
    engine = engine_for(model, "ghost")
    with pytest.raises(UserError, match="use_reentrant=True does not support; checkpoint with use_reentrant=False"):
        engine.accumulate(model(IDS))
    assert not engine.clipped_grads()
    engine.detach()
    model = Tiny(reentrant=False)
    expected_norms, expected = brute_force_of(model)
    engine = engine_for(model, "ghost")
    got_norms = engine.accumulate(model(IDS))
    got = {name: engine.clipped_grads()[p] for name, p in model.named_parameters()}
    assert compare(expected_norms, expected, got_norms, got) == []


@pytest.mark.parametrize("mode", MODES)
def test_lora_under_reentrant_checkpointing_is_exact_or_one_sentence_in_ghost(mode):
    """Hugging Face checkpointing with use_reentrant=True and peft LoRA: every adapter runs inside a checkpoint,
    so its use is recorded only when the backward pass recomputes it."""
    arch, where = BY_NAME["llama"], SITUATIONS["lora"]
    model = prepare(build(arch), where)
    batch = make_batch(arch, where)
    norms, expected = loop_brute_force(copy.deepcopy(model), batch, where.batch, False)
    model.train()
    model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    if mode == "ghost":
        with pytest.raises(UserError, match="inside activation checkpointing with use_reentrant=True"):
            engine_result(model, batch, mode, "all_layer")
        return
    assert compare(norms, expected, *engine_result(model, batch, mode, "all_layer")) == []


class OldStyleScale(torch.autograd.Function):
    """ctx in forward and no setup_context: plain autograd runs it, torch.func cannot."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(dim=tuple(range(grad.dim() - 1)))


class Scaled(nn.Module):
    """A layer without a rule: per_sample's torch.func fallback replays it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(8, dtype=torch.float64))

    def forward(self, x):
        return OldStyleScale.apply(x, self.w)


def test_an_old_style_autograd_function_in_per_sample_is_one_sentence():
    model = Tiny()
    model.fc = Scaled()
    engine = engine_for(model, "per_sample")
    with pytest.raises(UserError, match="^Scaled calls a torch.autograd.Function written the old way .* or freeze "
                                        "the layer.$"):
        engine.accumulate(model(IDS))
    assert not engine.clipped_grads()
