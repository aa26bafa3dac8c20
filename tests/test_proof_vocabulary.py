"""The probe's second shape on the first rows of the vocabulary (issue 42, ``dptext.privacy.proof.vocabulary``).

The input embedding and output head are cut to their first rows for the B = T shape only (the same parameter
objects, restored after); a rule wrong only at B = T on the tied matrix is still refused there; a forward that
needs the whole vocabulary is proven whole. The suite's conftest cuts every tiny vocabulary to 16 rows, so the
other probe tests take this path too.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptext.errors import UserError
from dptext.models import load_model
from dptext.privacy import PrivacyEngine
from dptext.privacy.norms.embedding import EmbeddingRule
from dptext.privacy.proof import verify
from dptext.privacy.proof.vocabulary import plan_vocabulary_cut


def engine_for(model):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return PrivacyEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=0.05, expected_batch_size=4,
                         dataset_size=100)


def llama(tied=True):
    model = load_model("tiny-llama", head="causal_lm")[0]
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    return model.train()


def test_the_plan_cuts_the_embedding_and_the_head_once_when_tied_and_each_when_not():
    tied, untied = llama(), llama(tied=False)
    vocab = tied.config.vocab_size
    cut = plan_vocabulary_cut(tied, vocab, rows=16)
    assert [attribute for _, attribute in cut.sizes] == ["num_embeddings", "out_features"]
    assert cut.params == [tied.lm_head.weight] and tied.lm_head.weight is tied.model.embed_tokens.weight
    assert len(plan_vocabulary_cut(untied, vocab, rows=16).params) == 2
    assert plan_vocabulary_cut(tied, vocab, rows=vocab // 2 + 1) is None  # not much larger: nothing to gain
    tied.model.embed_tokens.padding_idx = 20
    assert plan_vocabulary_cut(tied, vocab, rows=16) is None  # the padding row would be cut away


@pytest.mark.parametrize("tied", [True, False])
def test_the_second_shape_runs_on_the_cut_vocabulary_and_the_model_is_given_back_whole(monkeypatch, tied):
    model = llama(tied)
    embed, head = model.model.embed_tokens, model.lm_head
    before = (embed.weight.detach().clone(), head.weight.detach().clone())
    seen = []
    real = verify.probe_one

    def recording(engine, report, batch, *args):
        seen.append((embed.weight.shape[0], head.weight.shape[0], embed.num_embeddings, head.out_features,
                     int(batch["input_ids"].max())))
        return real(engine, report, batch, *args)

    monkeypatch.setattr(verify, "probe_one", recording)
    report = engine_for(model).verify()
    vocab = model.config.vocab_size
    assert seen[0][:4] == (vocab,) * 4 and seen[1][:4] == (16,) * 4 and seen[1][4] < 16
    assert {row.status for row in report.rows.values()} == {"exact"}
    assert (embed.weight.shape[0], head.weight.shape[0], embed.num_embeddings, head.out_features) == (vocab,) * 4
    assert torch.equal(embed.weight, before[0]) and torch.equal(head.weight, before[1])
    assert embed.weight.grad is None and head.weight.grad is None


def test_an_embedding_rule_wrong_only_at_b_equals_t_is_refused_on_the_cut_vocabulary(monkeypatch):
    """The mutant reads the batch's ids transposed when B = T (a layout that confuses examples with positions):
    only the second shape can see it, and it runs on the cut vocabulary."""
    for name in ("norm_sq", "clipped_sum"):
        real = getattr(EmbeddingRule, name)

        def transposed(self, module, names, ids, grad_output, *rest, _real=real):
            if ids.ndim == 2 and ids.shape[0] == ids.shape[1]:
                ids = ids.t().contiguous()
            return _real(self, module, names, ids, grad_output, *rest)

        monkeypatch.setattr(EmbeddingRule, name, transposed)
    cuts = []
    real_plan = verify.plan_vocabulary_cut
    monkeypatch.setattr(verify, "plan_vocabulary_cut", lambda *a, **k: cuts.append(real_plan(*a, **k)) or cuts[-1])
    with pytest.raises(UserError, match="embed_tokens|lm_head"):
        engine_for(llama()).verify()
    assert cuts and cuts[0] is not None


class VocabularyBias(nn.Module):
    """A causal LM whose forward adds a V-sized buffer to its logits (BART's ``final_logits_bias``)."""

    def __init__(self, vocab=40, width=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.register_buffer("final_logits_bias", torch.zeros(1, vocab))

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask=None):
        return self.head(torch.tanh(self.body(self.embed(input_ids)))) + self.final_logits_bias


def test_a_forward_that_needs_the_whole_vocabulary_is_proven_whole():
    model = VocabularyBias().train()
    report = engine_for(model).verify()
    assert any("proved the whole stack and vocabulary" in note for note in report.notes)
    assert {row.status for row in report.rows.values()} == {"exact"}
    assert model.head.weight.shape == (40, 8) and model.embed.num_embeddings == 40


def test_the_probe_of_the_suites_models_cuts_their_vocabulary():
    """The conftest's 16 rows are what every default-batch probe in the suite runs its second shape on."""
    model = llama()
    assert plan_vocabulary_cut(model, model.config.vocab_size) is not None
