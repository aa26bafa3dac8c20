"""torch's nn.MultiheadAttention is exact in every mode and layout (dptext/privacy/norms/multihead_attention.py).

Against brute-force per-example autograd (tiny fp64 models built here): sequence-first (the default) and
batch-first, self-attention and cross-attention (key is value, and three distinct inputs), with and without a
key-padding mask and an attention mask, bias on and off, B ≠ T and B = T; the replaced forward equals the
module's own to 1e-12; removing one example moves the clipped sum by at most C.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptext.errors import UserError
from dptext.privacy.proof.synthetic import output_functional_loss, synthetic_token_batch
from test_privacy_failclosed import CASES, CLIP, VOCAB, brute_force_clipped_sum, make_engine, verify_outcome

WIDTH = 8


class Attend(nn.Module):
    """Embedding → nn.MultiheadAttention → output (batch-first), in the layout and wiring under test."""

    def __init__(self, batch_first=False, inputs="self", bias=True, key_padding=False, attn_mask=None,
                 need_weights=True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.memory = nn.Embedding(VOCAB, WIDTH)
        self.attention = nn.MultiheadAttention(WIDTH, 2, bias=bias, batch_first=batch_first)
        self.inputs, self.key_padding, self.attn_mask, self.need_weights = inputs, key_padding, attn_mask, need_weights

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        keys = self.memory(input_ids.flip(1)[:, 1:]) if input_ids.shape[1] > 1 else self.memory(input_ids)
        key_mask = attention_mask[:, :keys.shape[1]] if attention_mask is not None else None
        if self.inputs == "self":
            query, key, value, key_mask = h, h, h, attention_mask
        elif self.inputs == "key_is_value":
            query, key, value = h, keys, keys
        else:
            query, key, value = h, keys, keys * 2.0
        if not self.attention.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
            if self.inputs == "self":
                key = value = query
            elif self.inputs == "key_is_value":
                value = key
        options = {"need_weights": self.need_weights}
        if self.key_padding and key_mask is not None:
            padded = key_mask == 0
            options["key_padding_mask"] = padded if self.attn_mask != "float" else \
                torch.zeros(padded.shape, dtype=h.dtype).masked_fill(padded, -1e4)  # one mask type, as torch asks
        if self.attn_mask is not None:
            length, sources = h.shape[1], key.shape[0 if not self.attention.batch_first else 1]
            causal = torch.ones(length, sources, dtype=torch.bool).triu(1)
            options["attn_mask"] = causal if self.attn_mask == "bool" else \
                torch.zeros(length, sources, dtype=h.dtype).masked_fill(causal, -1e4)
        out, _ = self.attention(query, key, value, **options)
        return out if self.attention.batch_first else out.transpose(0, 1)


def exact_against_brute_force(model, mode, layout, rows, length):
    model = model.double()
    batch = synthetic_token_batch(model)(rows, length, torch.Generator().manual_seed(rows * 10 + length))
    params = [p for p in model.parameters() if p.requires_grad]
    expected = brute_force_clipped_sum(model, batch, params, layout)
    engine, _ = make_engine(model, mode, layout)
    try:
        engine.accumulate(output_functional_loss(model, batch))
        sums = engine.clipped_grads()
    finally:
        engine.detach()
    return all(torch.allclose(sums.get(p, torch.zeros_like(p)).double(), e, rtol=1e-5, atol=1e-6 * CLIP)
               for p, e in zip(params, expected))


WIRINGS = [dict(inputs="self"), dict(inputs="key_is_value"), dict(inputs="distinct"),
           dict(inputs="self", key_padding=True, attn_mask="bool"),
           dict(inputs="distinct", key_padding=True, attn_mask="float", bias=False),
           dict(inputs="self", need_weights=False, key_padding=True)]


@pytest.mark.parametrize("mode,layout", CASES)
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("wiring", WIRINGS, ids=lambda w: "-".join(f"{k}={v}" for k, v in w.items()))
def test_multihead_attention_is_exact(wiring, batch_first, mode, layout):
    torch.manual_seed(0)
    for rows, length in ((3, 5), (4, 4)):  # B ≠ T and B = T: the layout comes from batch_first, not a shape
        assert exact_against_brute_force(Attend(batch_first, **wiring), mode, layout, rows, length)


@pytest.mark.parametrize("mode,layout", CASES)
def test_multihead_attention_passes_the_probe_and_the_sensitivity_test(mode, layout):
    torch.manual_seed(1)
    assert verify_outcome(Attend(False, inputs="distinct", key_padding=True), mode, layout) == "exact"


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("wiring", WIRINGS[:5], ids=lambda w: "-".join(f"{k}={v}" for k, v in w.items()))
def test_the_replaced_forward_equals_the_modules_own(wiring, batch_first):
    torch.manual_seed(2)
    model = Attend(batch_first, **wiring).double().train()  # training: dropout off (p = 0) but slow path
    batch = synthetic_token_batch(model)(3, 6, torch.Generator().manual_seed(3))
    own = model(**batch)
    engine, _ = make_engine(model, "bookkeeping")
    replaced = model(**batch)
    engine.detach()
    assert "forward" not in vars(model.attention)  # detach gives the module its own forward back
    torch.testing.assert_close(replaced, own, rtol=1e-12, atol=1e-12)


def test_only_out_proj_trainable_is_exact():
    torch.manual_seed(3)
    model = Attend(False, inputs="distinct")
    model.attention.in_proj_weight.requires_grad_(False)
    model.attention.in_proj_bias.requires_grad_(False)
    assert exact_against_brute_force(model, "bookkeeping", "all_layer", 3, 5)
    assert exact_against_brute_force(model, "ghost", "all_layer", 4, 4)


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
def test_trainable_bias_kv_is_refused_naming_the_layer(mode):
    model = Attend(True)
    model.attention = nn.MultiheadAttention(WIDTH, 2, batch_first=True, add_bias_kv=True)
    with pytest.raises(UserError, match=r"Layer 'attention' \(MultiheadAttention\).*bias_k"):
        make_engine(model, mode)
    model.attention.bias_k.requires_grad_(False)
    model.attention.bias_v.requires_grad_(False)
    assert exact_against_brute_force(model, mode, "all_layer", 3, 5)
