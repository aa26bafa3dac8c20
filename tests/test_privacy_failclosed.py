"""The fail-closed engine (issues 14 and 23): every pattern is exact against brute force or refused, never wrong.

Tiny fp64 modules built here, through the public API (``PrivacyEngine``, ``engine.verify()``), in all three
clipping modes and both layouts. "Exact" is checked against per-example autograd and by the remove-one-example
sensitivity test (‖Σ clipped(D) − Σ clipped(D − {j})‖ ≤ C); "refused" must name the layer.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from dptext.errors import UserError
from dptext.privacy import PrivacyEngine
from dptext.privacy.verify import output_functional_loss, synthetic_token_batch

CASES = [(mode, layout) for mode in ("bookkeeping", "ghost", "per_sample") for layout in ("all_layer", "per_layer")
         if not (mode == "ghost" and layout == "per_layer")]
CLIP = 0.05
VOCAB, WIDTH = 11, 6


class Tiny(nn.Module):
    """Embedding → body → output; ``body(h, module)`` is the pattern under test."""

    def __init__(self, body=None, extra: nn.Module | None = None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.extra = extra
        self.body = body or (lambda h, m: m.fc(h))

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None):
        return self.body(self.embed(input_ids), self)


def make_engine(model, mode, layout="all_layer", **kwargs):
    model = model.double()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    engine = PrivacyEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=CLIP, expected_batch_size=4,
                           dataset_size=100, clipping_mode=mode, clipping_layout=layout, **kwargs)
    return engine, optimizer


def clipped_sum(engine, batch, rows):
    engine.zero_grad()
    loss = output_functional_loss(engine.model, {k: v[rows] for k, v in batch.items()})
    engine.accumulate(loss)
    sums = engine.clipped_grads()
    engine.zero_grad()
    return sums


def assert_sensitivity(engine, batch):
    """Removing any one example moves the clipped sum by at most C."""
    full = clipped_sum(engine, batch, slice(None))
    examples = batch["input_ids"].shape[0]
    for j in range(examples):
        rows = torch.tensor([i for i in range(examples) if i != j])
        rest = clipped_sum(engine, batch, rows)
        moved = sum(float((full[p] - rest.get(p, torch.zeros_like(full[p]))).pow(2).sum()) for p in full) ** 0.5
        assert moved <= CLIP * (1 + 1e-6)


def verify_outcome(model, mode, layout="all_layer"):
    """'exact' (probe passed and the sensitivity test holds) or the refusal's message."""
    engine, _ = make_engine(model, mode, layout)
    try:
        engine.verify()
    except UserError as error:
        return str(error)
    batch = synthetic_token_batch(model)(5, 7, torch.Generator().manual_seed(5))
    assert_sensitivity(engine, batch)
    return "exact"


def relu_inplace(h, m):
    return F.relu(m.fc(h), inplace=True)


def mul_inplace(h, m):
    return m.fc(h).mul_(2.0)


def functional_head(h, m):  # the embedding weight read again outside its module, as an LM head
    return F.linear(m.fc(h), m.embed.weight)


def shared_weight(h, m):  # a second Linear holding the first one's weight, no cross-term rule needed
    return m.extra(m.fc(h))


def sequence_first(h, m):  # the layer sees (T, B, d): rows are positions
    return m.fc(h.transpose(0, 1)).transpose(0, 1)


def gathered_rows(h, m):  # an "expert" fed the tokens of all examples as rows
    flat = h.reshape(-1, h.shape[-1])
    return m.fc(flat[flat[:, 0] > -1e9]).reshape(h.shape)


def keyword_input(h, m):
    return m.fc(input=h)


@pytest.mark.parametrize("mode,layout", CASES)
@pytest.mark.parametrize("body,fragment", [
    (relu_inplace, "'fc'"), (mul_inplace, "'fc'"), (functional_head, "'embed'"), (sequence_first, "'fc'"),
    (gathered_rows, "'fc'")])
def test_broken_patterns_are_refused_with_the_layer_name(body, fragment, mode, layout):
    outcome = verify_outcome(Tiny(body), mode, layout)
    assert outcome != "exact" and fragment in outcome


@pytest.mark.parametrize("mode,layout", CASES)
def test_plain_and_keyword_calls_are_exact(mode, layout):
    assert verify_outcome(Tiny(), mode, layout) == "exact"
    assert verify_outcome(Tiny(keyword_input), mode, layout) == "exact"


@pytest.mark.parametrize("mode,layout", CASES)
def test_weight_shared_by_two_modules_is_exact_or_refused(mode, layout):
    model = Tiny(shared_weight, extra=nn.Linear(WIDTH, WIDTH, bias=False))
    model.extra.weight = model.fc.weight
    outcome = verify_outcome(model, mode, layout)
    assert outcome == "exact" or "'fc'" in outcome or "'extra'" in outcome


def test_linear_followed_by_inplace_relu_in_a_sequential_is_caught_by_the_probe():
    model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.ReLU(inplace=True),
                          nn.Linear(WIDTH, 3))
    engine, _ = make_engine(model, "bookkeeping")
    batch = synthetic_token_batch(model[0])
    with pytest.raises(UserError, match=r"layer '1' \(Linear\).*in place"):
        engine.verify(make_batch=lambda b, t, g: {"input_ids": batch(b, t, g)["input_ids"]},
                      loss_fn=lambda m, x: m(x["input_ids"]).sum(dim=(1, 2)))
