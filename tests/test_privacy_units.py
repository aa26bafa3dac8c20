"""Per-unit clipping (user-level DP, issue 24): each unit's summed gradient clipped to C as one vector.

The reference is per-unit autograd: one backward pass of the sum of a unit's per-example losses, per unit. Units
of unequal sizes, one whose rows are not contiguous, padding, tied embeddings, LayerNorm (GPT-2) and RMSNorm
(Llama), in every clipping mode and both layouts; then the sensitivity: removing a whole unit moves the clipped sum
by at most C.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from dptext.errors import UserError
from dptext.models import load_model
from dptext.privacy import PrivacyEngine, per_example_loss

CLIP = 0.5
RTOL = 1e-5  # fp64 models; the engine forms norms and factors in fp32
# unit 7 holds rows 0, 2 and 5 (not contiguous), unit 3 rows 1 and 4, unit 9 row 3 alone
UNITS = torch.tensor([7, 3, 7, 9, 3, 7])
LAYOUTS = [("bookkeeping", "all_layer"), ("bookkeeping", "per_layer"), ("ghost", "all_layer"),
           ("per_sample", "all_layer"), ("per_sample", "per_layer")]


def padded_batch(rows: int = 6, length: int = 10, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 200, (rows, length), generator=generator)
    mask = torch.zeros(rows, length, dtype=torch.long)
    for i, n in enumerate([length, 7, 4, length, 3, 6][:rows]):
        mask[i, :n] = 1
    ids[mask == 0] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def losses(model: nn.Module, batch: dict, rows) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"][rows], attention_mask=batch["attention_mask"][rows]).logits
    causal = not model.config.model_type.startswith("bert")
    return per_example_loss(logits, batch["labels"][rows], batch["attention_mask"][rows], shift=causal,
                            reduction="sum")


def tiny(name: str) -> nn.Module:
    model, _ = load_model(name, head="masked_lm" if name == "tiny-bert" else "causal_lm")
    return model.double()


def per_unit_brute_force(model: nn.Module, batch: dict, units: torch.Tensor, per_layer: bool):
    """Per-unit norms (in sorted unit order) and clipped sums by one backward pass per unit."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = []
    for unit in units.unique().tolist():
        rows = (units == unit).nonzero().flatten()
        row_grads = torch.autograd.grad(losses(model, batch, rows).sum(), [p for _, p in named], allow_unused=True)
        grads.append([torch.zeros_like(p) if g is None else g for g, (_, p) in zip(row_grads, named)])
    norms = torch.stack([torch.stack([g.pow(2).sum() for g in unit]).sum().sqrt() for unit in grads])
    sums = {}
    for k, (name, _) in enumerate(named):
        if per_layer:
            coef = [min(1.0, CLIP / math.sqrt(len(named)) / (float(unit[k].norm()) + 1e-6)) for unit in grads]
        else:
            coef = (CLIP / (norms + 1e-6)).clamp(max=1.0).tolist()
        sums[name] = sum(c * unit[k] for c, unit in zip(coef, grads))
    return norms, sums


def make_engine(model: nn.Module, mode: str, layout: str = "all_layer") -> PrivacyEngine:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    engine = PrivacyEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=CLIP, expected_batch_size=3,
                           dataset_size=100, clipping_mode=mode, clipping_layout=layout, verify=False)
    engine.max_examples_per_user = 6  # user-level, as engine.user_sampler() makes it: accumulate takes units then
    return engine


def engine_sums(model: nn.Module, batch: dict, units, mode: str, layout: str = "all_layer", rows=None):
    engine = make_engine(model, mode, layout)
    rows = torch.arange(len(batch["input_ids"])) if rows is None else rows
    norms = engine.accumulate(losses(model, batch, rows), units=units)
    names = {param: name for name, param in model.named_parameters()}
    return norms, {names[param]: total for param, total in engine.clipped_grads().items()}


def assert_sums_match(got: dict, expected: dict) -> None:
    scale = max(float(e.abs().max()) for e in expected.values())
    report, failed = [], False
    for name, value in expected.items():
        error = float((got.get(name, torch.zeros_like(value)) - value).abs().max())
        bad = error > RTOL * max(float(value.abs().max()), 1e-2 * scale)
        failed |= bad
        report.append(f"{'FAIL' if bad else 'ok  '} {name}: max abs error {error:.3e}")
    assert not failed, "per-unit clipped sums differ from brute force:\n" + "\n".join(report)


@pytest.mark.parametrize("mode,layout", LAYOUTS)
@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_per_unit_clipping_matches_per_unit_autograd(name, mode, layout):
    model, batch = tiny(name), padded_batch()
    norms, expected = per_unit_brute_force(copy.deepcopy(model), batch, UNITS, layout == "per_layer")
    assert float(norms.max()) > CLIP  # the clipping really bites for some unit
    got_norms, got = engine_sums(model, batch, UNITS, mode, layout)
    torch.testing.assert_close(got_norms.double(), norms, rtol=RTOL, atol=1e-7)
    assert_sums_match(got, expected)


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
def test_per_unit_clipping_on_bert_position_and_token_type_tables(mode):
    # untied tables looked up by position (no outer form of their own: instantiated per unit) and LayerNorms
    model, batch = tiny("tiny-bert"), padded_batch()
    norms, expected = per_unit_brute_force(copy.deepcopy(model), batch, UNITS, per_layer=False)
    got_norms, got = engine_sums(model, batch, UNITS, mode)
    torch.testing.assert_close(got_norms.double(), norms, rtol=RTOL, atol=1e-7)
    assert_sums_match(got, expected)


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
def test_per_unit_norms_are_not_the_per_example_ones(mode):
    # the cross terms matter: summed per-example clipping would give a different answer
    model, batch = tiny("tiny-gpt2"), padded_batch()
    per_example, _ = engine_sums(copy.deepcopy(model), batch, None, mode)
    per_unit, _ = engine_sums(model, batch, UNITS, mode)
    assert per_example.shape == (6,) and per_unit.shape == (3,)
    unit_7 = float(per_unit[1])  # sorted ids 3, 7, 9
    assert abs(unit_7 - float(per_example[[0, 2, 5]].pow(2).sum().sqrt())) > 1e-3 * unit_7


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
def test_units_of_one_example_each_are_todays_clipping(mode):
    model, batch = tiny("tiny-llama"), padded_batch()
    plain_norms, plain = engine_sums(copy.deepcopy(model), batch, None, mode)
    norms, sums = engine_sums(model, batch, torch.tensor([5, 1, 4, 0, 2, 3]), mode)
    torch.testing.assert_close(norms, plain_norms)
    assert_sums_match(sums, plain)


@pytest.mark.parametrize("mode,layout", LAYOUTS)
def test_removing_one_unit_moves_the_clipped_sum_by_at_most_c(mode, layout):
    model, batch = tiny("tiny-gpt2"), padded_batch()
    _, with_unit = engine_sums(copy.deepcopy(model), batch, UNITS, mode, layout)
    others = (UNITS != 7).nonzero().flatten()
    _, without = engine_sums(model, batch, UNITS[others], mode, layout, rows=others)
    moved = math.sqrt(sum(float((with_unit[n] - without.get(n, 0 * with_unit[n])).pow(2).sum()) for n in with_unit))
    assert 0.5 * CLIP < moved <= CLIP * (1 + 1e-9)  # unit 7 is clipped (its norm exceeds C) and moves it by ≤ C


def test_a_unit_split_over_two_accumulate_calls_is_refused():
    model, batch = tiny("tiny-gpt2"), padded_batch()
    engine = make_engine(model, "bookkeeping")
    engine.accumulate(losses(model, batch, torch.arange(3)), units=UNITS[:3])
    with pytest.raises(UserError, match="split over two accumulate calls"):
        engine.accumulate(losses(model, batch, torch.arange(3, 6)), units=UNITS[3:])
    engine.zero_grad()  # a new logical batch may hold the unit again
    engine.accumulate(losses(model, batch, torch.arange(3, 6)), units=UNITS[3:])
    with pytest.raises(UserError, match="with and without units"):
        engine.accumulate(losses(model, batch, torch.arange(2)))


def test_units_of_the_wrong_shape_are_refused():
    model, batch = tiny("tiny-gpt2"), padded_batch()
    engine = make_engine(model, "bookkeeping")
    with pytest.raises(UserError, match="one unit id per example"):
        engine.accumulate(losses(model, batch, torch.arange(6)), units=torch.tensor([0.0, 1, 2, 3, 4, 5]))
    engine.zero_grad()
    engine.accumulate(losses(model, batch, torch.arange(6)), units=UNITS)  # the batch is usable again after zero_grad


def test_user_batches_from_the_engine_clip_each_user_within_c():
    # the engine's own user sampler (q over users) feeds accumulate; every user's summed gradient is clipped to C
    model, batch = tiny("tiny-gpt2"), padded_batch()
    users = [[0, 2, 5], [1, 4], [3]]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = PrivacyEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=CLIP, sample_rate=0.7,
                           dataset_size=len(users), seed=0, verify=False)
    steps = list(engine.user_sampler(users, max_examples_per_user=2, steps=6))
    assert any(len(set(step.users)) > 1 for step in steps) and all(len(step.indices) <= 5 for step in steps)
    for step in steps:
        if not step.indices:
            continue
        engine.zero_grad()
        norms = engine.accumulate(losses(model, batch, torch.tensor(step.indices)), units=step.users)
        assert norms.shape == (len(set(step.users)),)
        total = math.sqrt(sum(float(t.pow(2).sum()) for t in engine.clipped_grads().values()))
        assert total <= len(set(step.users)) * CLIP * (1 + 1e-6)
    with pytest.raises(UserError, match="number of users"):
        engine.user_sampler(users + [[6]], max_examples_per_user=2, steps=1)


class AttentionClassifier(nn.Module):
    """Embedding with a padding row, torch's MultiheadAttention, LayerNorm and a linear head, in fp64."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(30, 8, padding_idx=0)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)
        self.double()

    def forward(self, input_ids):
        x = self.embed(input_ids)
        x = self.norm(x + self.attention(x, x, x, need_weights=False)[0])
        return self.head(x.mean(dim=1))


@pytest.mark.parametrize("mode,layout", LAYOUTS)
def test_per_unit_clipping_through_multihead_attention(mode, layout):
    ids = torch.randint(1, 30, (6, 5), generator=torch.Generator().manual_seed(1))
    ids[1, 3:] = 0
    labels = torch.tensor([0, 1, 2, 1, 0, 2])

    def unit_losses(model, rows):
        return nn.functional.cross_entropy(model(ids[rows]), labels[rows], reduction="none")

    model = AttentionClassifier()
    reference = copy.deepcopy(model)
    named = [(n, p) for n, p in reference.named_parameters()]
    grads = [torch.autograd.grad(unit_losses(reference, (UNITS == u).nonzero().flatten()).sum(),
                                 [p for _, p in named]) for u in UNITS.unique().tolist()]
    norms = torch.stack([torch.stack([g.pow(2).sum() for g in unit]).sum().sqrt() for unit in grads])
    assert float(norms.max()) > CLIP  # the clipping bites
    per_layer = layout == "per_layer"
    expected = {}
    for k, (name, _) in enumerate(named):
        coef = [min(1.0, CLIP / math.sqrt(len(named)) / (float(unit[k].norm()) + 1e-6)) for unit in grads] \
            if per_layer else (CLIP / (norms + 1e-6)).clamp(max=1.0).tolist()
        expected[name] = sum(c * unit[k] for c, unit in zip(coef, grads))
    engine = make_engine(model, mode, layout)
    got_norms = engine.accumulate(unit_losses(model, torch.arange(6)), units=UNITS)
    torch.testing.assert_close(got_norms.double(), norms, rtol=RTOL, atol=1e-7)
    names = {param: name for name, param in model.named_parameters()}
    assert_sums_match({names[p]: t for p, t in engine.clipped_grads().items()}, expected)


def test_units_are_refused_where_the_engine_is_accounted_per_example():
    # red team (session 29): units passed to an engine whose batches come from engine.sampler() (ε about single
    # examples) clipped each unit's sum, so one example moved the clipped sum by 2C against the accounted C
    model, batch = tiny("tiny-gpt2"), padded_batch()
    engine = make_engine(model, "bookkeeping")
    engine.max_examples_per_user = None  # as built: no user_sampler()
    with pytest.raises(UserError, match="user_sampler"):
        engine.accumulate(losses(model, batch, torch.arange(6)), units=UNITS)
    engine.accumulate(losses(model, batch, torch.arange(6)))  # one unit per example: accepted
