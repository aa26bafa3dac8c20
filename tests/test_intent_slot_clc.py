"""The CLC model (char CNN + word embedding + bi-LSTM): its LSTM against nn.LSTM, and the privacy engine's
clipped sums for the whole joint CLC model (+ CRF) against brute-force per-example autograd in every mode."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dptext import config
from dptext.errors import UserError
from dptext.privacy import PrivacyEngine
from dptext.tasks import build_task
from dptext.tasks.clc import BiLSTM, WordTokenizer

MODES = ("bookkeeping", "ghost", "per_sample")


def test_bilstm_equals_torch_lstm_on_each_example_alone():
    torch.manual_seed(0)
    ours = BiLSTM(5, 4)
    reference = nn.LSTM(5, 4, batch_first=True, bidirectional=True)
    with torch.no_grad():
        for direction, suffix in ((0, ""), (1, "_reverse")):
            getattr(reference, f"weight_ih_l0{suffix}").copy_(ours.weight_ih[direction])
            getattr(reference, f"weight_hh_l0{suffix}").copy_(ours.weight_hh[direction])
            getattr(reference, f"bias_ih_l0{suffix}").copy_(ours.bias[direction])
            getattr(reference, f"bias_hh_l0{suffix}").zero_()
    x, lengths = torch.randn(3, 6, 5), [6, 4, 1]
    mask = (torch.arange(6) < torch.tensor(lengths).unsqueeze(1)).long()
    out = ours(x, mask)
    for row, length in enumerate(lengths):
        expected, _ = reference(x[row:row + 1, :length])
        torch.testing.assert_close(out[row, :length], expected[0], rtol=1e-5, atol=1e-6)
        assert out[row, length:].abs().sum() == 0  # padding positions are zero


# Six records: the batch (6) equals no other dimension (5 words, 8 characters), so the shapes prove which BiLSTM
# inputs carry the batch and the engine needs no probe; at B = T it refuses instead (test below).
RECORDS = [
    {"tokens": ["fly", "to", "boston"], "tags": ["O", "O", "B-toloc"], "intent": "flight"},
    {"tokens": ["fly", "from", "denver"], "tags": ["O", "O", "B-from"], "intent": "flight"},
    {"tokens": ["cheapest", "fare", "from", "new", "york"], "tags": ["B-cost", "O", "O", "B-from", "I-from"],
     "intent": "airfare"},
    {"tokens": ["list", "airlines"], "tags": ["O", "O"], "intent": "airline"},
    {"tokens": ["to", "denver", "tomorrow"], "tags": ["O", "B-toloc", "B-date"], "intent": "flight"},
    {"tokens": ["xyzzy"], "tags": ["O"], "intent": "airline"},
]


@pytest.mark.parametrize("mode", MODES)
def test_clc_joint_model_clips_like_per_example_autograd(mode):
    recipe = config.load_recipe(None, ["task.type=intent_slot", "data.dataset=atis", "model.name=tiny-clc",
                                       "task.crf=true", "task.pooling=mean", "task.intents=[flight, airfare, airline]",
                                       "task.slot_types=[toloc, cost, from, date]"])
    words = ["fly", "to", "boston", "cheapest", "fare", "from", "new", "york", "list", "airlines", "denver"]
    task = build_task(recipe, WordTokenizer(words, "abcdefghijklmnopqrstuvwxyz"), RECORDS[:5])  # "xyzzy": <unk>
    model = task.load_model().eval()  # no dropout: the engine's forward and the brute force must agree
    batch = task.collate(task.encode(RECORDS))
    assert batch["char_ids"].shape[:2] == batch["input_ids"].shape
    reference, clip = copy.deepcopy(model), 1.0
    names = [n for n, p in reference.named_parameters() if p.requires_grad]
    params = [p for p in reference.parameters() if p.requires_grad]
    rows = []
    for i in range(len(RECORDS)):
        one = {k: v[i:i + 1] for k, v in batch.items()}
        one = {k: v[:, :int(one["attention_mask"].sum())] if v.ndim > 1 else v for k, v in one.items()}
        grads = torch.autograd.grad(task.per_example_loss(reference, one).sum(), params, allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)])
    norms = torch.stack([torch.stack([g.pow(2).sum() for g in row]).sum().sqrt() for row in rows])
    coef = (clip / (norms + 1e-6)).clamp(max=1)
    expected = {n: sum(c * row[k] for c, row in zip(coef, rows)) for k, n in enumerate(names)}

    engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0,
                           max_grad_norm=clip, expected_batch_size=6, dataset_size=50, clipping_mode=mode, verify=False)
    torch.testing.assert_close(engine.accumulate(task.per_example_loss(model, batch)), norms, rtol=1e-4, atol=1e-5)
    got = engine.clipped_grads()
    errors = {n: float((got[p] - expected[n]).abs().max()) for n, p in model.named_parameters() if n in expected}
    assert len(errors) == len(expected) and all(e < 1e-4 for e in errors.values()), errors
    assert any(n.startswith("encoder.lstm.") for n in errors) and "classifier.crf.transitions" in errors


def test_what_one_engine_learned_about_a_layer_never_decides_for_another_engine():
    """The rule registry holds one FunctionalRule per layer class; its learned input layout was process-wide, so
    after any engine had seen a BiLSTM at B != T, a fresh engine on another model accepted B = T unproven (and this
    file's own test passed or failed by test order). Each engine now learns for its own layers."""
    recipe = config.load_recipe(None, ["task.type=intent_slot", "data.dataset=atis", "model.name=tiny-clc",
                                       "task.intents=[flight, airfare, airline]",
                                       "task.slot_types=[toloc, cost, from, date]"])
    words = ["fly", "to", "boston", "cheapest", "fare", "from", "new", "york", "list", "airlines", "denver"]
    task = build_task(recipe, WordTokenizer(words, "abcdefghijklmnopqrstuvwxyz"), RECORDS[:5])

    def engine_for(model):
        return PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0,
                             max_grad_norm=1.0, expected_batch_size=5, dataset_size=50, clipping_mode="ghost",
                             verify=False)
    proving = task.collate(task.encode(RECORDS))  # B = 6: the layout is provable
    model = task.load_model().eval()
    engine_for(model).accumulate(task.per_example_loss(model, proving))
    ambiguous = task.collate(task.encode(RECORDS[1:]))  # B = 5 = T
    assert ambiguous["input_ids"].shape == (5, 5)
    other = task.load_model().eval()
    with pytest.raises(UserError, match="cannot be proven from their shapes"):
        engine_for(other).accumulate(task.per_example_loss(other, ambiguous))


def test_clc_vocabulary_is_public_and_fixed_not_built_from_the_records():
    """Issue 21 point 8: a word of the private records must not reach the saved vocabulary."""
    from dptext.models import load_tokenizer

    tokenizer = load_tokenizer("tiny-clc")
    assert "boston" in tokenizer.words and "qzxvcanaryword" not in tokenizer.words
    recipe = config.load_recipe(None, ["task.type=intent_slot", "data.dataset=atis", "model.name=tiny-clc",
                                       "task.intents=[flight]", "task.slot_types=[toloc]"])
    records = [{"tokens": ["fly", "to", "qzxvcanaryword"], "tags": ["O", "O", "B-toloc"], "intent": "flight"}]
    before = dict(tokenizer.words)
    task = build_task(recipe, tokenizer, records)
    assert tokenizer.words == before  # building the task learnt nothing from the records
    assert task.encode(records)[0].input_ids[2] == 1  # the canary word is <unk>
