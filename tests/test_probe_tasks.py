"""Every task hands the start-up probe its own synthetic batch and its own per-example loss (issues 14 and 23).

For each task type (causal LM plain / control-coded, table-to-text, dialog, distillation with the teacher's
logits and hidden states in the loss, classification with the model's and
with mean pooling, infilling, intent-slot with and without CRF, and the CLC encoder) on a tiny fp64 model, in all
three clipping modes: the probe accepts it, and on the task's probe batch the engine's clipped sums equal
brute-force per-example autograd with the task's loss. A task whose loss lets examples interact is refused, and
the probe batch is synthetic (its tokens are not drawn from any record); a batch the model cannot take is a
one-sentence refusal, not a traceback.
"""

from __future__ import annotations

import pytest
import torch

from dptext import config
from dptext.errors import UserError
from dptext.distill.task import DistillationTask
from dptext.finetune.setup import verify_with_task
from dptext.models import load_model, load_tokenizer
from dptext.privacy import PrivacyEngine
from dptext.tasks import build_task
from dptext.tasks.classification import ClassificationTask
from dptext.tasks.clc import WordTokenizer

MODES = ("bookkeeping", "ghost", "per_sample")
CLIP = 0.05
SLOTS = ["task.type=intent_slot", "data.dataset=atis", "task.intents=[flight, airfare]", "task.slot_types=[toloc]"]
TASKS = {
    "language_modeling": ["task.type=language_modeling", "model.name=tiny-gpt2", "data.dataset=amazon",
                          "task.control_codes=[category]"],
    "table_to_text": ["task.type=table_to_text", "model.name=tiny-gpt2", "data.dataset=e2e"],
    "dialog": ["task.type=dialog", "model.name=tiny-llama", "data.dataset=chitchat"],
    "classification": ["task.type=classification", "model.name=tiny-bert", "data.dataset=sst2"],
    "classification_mean": ["task.type=classification", "model.name=tiny-bert", "data.dataset=sst2",
                            "task.pooling=mean"],
    "infilling": ["task.type=infilling", "model.name=tiny-roberta", "data.dataset=sst2",
                  "task.template=<S1> It was [MASK] .", "task.label_words=[-, +]"],
    "intent_slot": SLOTS + ["model.name=tiny-bert"],
    "intent_slot_crf": SLOTS + ["model.name=tiny-bert", "task.crf=true", "task.pooling=mean"],
    "intent_slot_clc": SLOTS + ["model.name=tiny-clc", "task.crf=true", "task.pooling=mean"],
    "distillation": ["task.type=language_modeling", "model.name=tiny-gpt2", "data.dataset=amazon",
                     "distill.kd_lambda=0.5", "distill.temperature=2.0", "distill.hidden_alpha=0.3"],
}
RECORDS = {
    "classification": [{"text": "good", "label": 1}, {"text": "bad", "label": 0}],
    "intent_slot": [{"tokens": ["fly", "to", "boston"], "tags": ["O", "O", "B-toloc"], "intent": "flight"},
                    {"tokens": ["fares", "please"], "tags": ["O", "O"], "intent": "airfare"}],
}


def build(name: str, task_class=None):
    recipe = config.load_recipe(None, TASKS[name])
    records = RECORDS["intent_slot" if name.startswith("intent_slot") else "classification"]
    if name == "intent_slot_clc":
        tokenizer = WordTokenizer(["fly", "to", "boston", "fares", "please"], "abcdefghijklmnopqrstuvwxyz")
    else:
        tokenizer = load_tokenizer(recipe.model.name)
    if name == "distillation":  # the teacher's logits and hidden states are in the loss the probe checks
        teacher, _ = load_model("tiny-gpt2", head="causal_lm")
        task = DistillationTask(recipe, tokenizer, teacher.eval().requires_grad_(False))
    elif task_class:
        task = task_class(recipe, tokenizer, records)
    else:
        task = build_task(recipe, tokenizer, records)
    torch.manual_seed(0)
    model = task.load_model().double()
    model.train()
    return task, model


def engine_for(model, mode):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return PrivacyEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=CLIP, expected_batch_size=4,
                         dataset_size=100, clipping_mode=mode, verify=False)


def brute_force(task, model, batch):
    """Σ_i clip(∇ loss_i) with each example's loss from a batch of that example alone."""
    params = [p for p in model.parameters() if p.requires_grad]
    examples = batch["input_ids"].shape[0]
    rows = []
    for i in range(examples):
        one = {k: v[i:i + 1] for k, v in batch.items()}
        grads = torch.autograd.grad(task.per_example_loss(model, one).sum(), params, allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)])
    norms = [float(sum(g.double().pow(2).sum() for g in row).sqrt()) for row in rows]
    coef = [min(1.0, CLIP / (n + 1e-6)) for n in norms]
    return {p: sum(c * row[k] for c, row in zip(coef, rows)) for k, p in enumerate(params)}


# every task in the default mode, the tasks with their own layers (pooling, CRF, CLC) and one causal LM in all
# three; the full cross product is slow
FAST_IN_EVERY_MODE = {"language_modeling", "classification_mean", "intent_slot_crf", "intent_slot_clc"}
CELLS = [pytest.param(name, mode, marks=() if mode == "bookkeeping" or name in FAST_IN_EVERY_MODE
                      else pytest.mark.slow) for name in sorted(TASKS) for mode in MODES]


@pytest.mark.parametrize("name,mode", CELLS)
def test_every_task_is_probed_with_its_own_batch_and_loss_and_is_exact(name, mode):
    task, model = build(name)
    model.eval()  # no dropout, so one-example batches see the same network as the batched pass
    batch = task.probe_batch(model, torch.Generator().manual_seed(7), 3, 5)
    expected = brute_force(task, model, batch)
    engine = engine_for(model, mode)
    verify_with_task(engine, task, model)
    assert engine.verified
    engine.accumulate(task.per_example_loss(model, batch))
    got = engine.clipped_grads()
    for param, value in expected.items():
        torch.testing.assert_close(got.get(param, torch.zeros_like(value)).double(), value.double(),
                                   rtol=1e-4, atol=1e-7)


class InBatchNegatives(ClassificationTask):
    """A contrastive loss: each example's loss depends on the other examples' logits."""

    def per_example_loss(self, model, batch):
        logits = self.logits(model, batch)
        return -torch.log_softmax(logits @ logits.t(), dim=1).diagonal()


@pytest.mark.parametrize("mode", MODES)
def test_a_task_loss_where_examples_interact_is_refused(mode):
    task, model = build("classification", InBatchNegatives)
    with pytest.raises(UserError, match="refused the loss: changing one example"):
        verify_with_task(engine_for(model, mode), task, model)


def test_probe_batches_are_synthetic_and_shaped_by_the_probe_only():
    for name in ("intent_slot_clc", "infilling", "dialog"):
        task, model = build(name)
        first = task.probe_batch(model, torch.Generator().manual_seed(1), 4, 4)
        again = task.probe_batch(model, torch.Generator().manual_seed(2), 4, 4)
        assert {k: v.shape for k, v in first.items()} == {k: v.shape for k, v in again.items()}
        assert all(v.shape[0] == 4 for v in first.values())
        assert not torch.equal(first["input_ids"], again["input_ids"])  # drawn, not read from records


class NeedsDecoderIds(torch.nn.Module):
    """An encoder-decoder-like forward that the default synthetic batch (ids and mask only) does not fit."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None, decoder_input_ids=None):
        if decoder_input_ids is None:
            raise ValueError("You must specify exactly one of decoder_input_ids or decoder_inputs_embeds")
        return self.embed(decoder_input_ids)


def test_a_probe_batch_the_model_cannot_take_is_a_one_sentence_refusal():
    engine = engine_for(NeedsDecoderIds().double(), "bookkeeping")
    with pytest.raises(UserError, match=r"could not run this model on its synthetic batch \(ValueError"):
        engine.verify()
