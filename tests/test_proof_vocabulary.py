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
    assert [attribute for _, attribute in cut.sizes] == ["num_embeddings", "out_features", "vocab_size"]
    assert cut.rows == 2 * tied.config.hidden_size  # at least twice the width: size-based choices as in training
    assert cut.params == [tied.lm_head.weight] and tied.lm_head.weight is tied.model.embed_tokens.weight
    assert len(plan_vocabulary_cut(untied, vocab, rows=16).params) == 2
    assert plan_vocabulary_cut(tied, vocab, rows=vocab // 2 + 1) is None  # not much larger: nothing to gain
    tied.model.embed_tokens.padding_idx = 2 * tied.config.hidden_size
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
    vocab, rows = model.config.vocab_size, 2 * model.config.hidden_size
    assert seen[0][:4] == (vocab,) * 4 and seen[1][:4] == (rows,) * 4 and seen[1][4] < rows
    assert model.config.vocab_size == vocab
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


class WrittenOnce(VocabularyBias):
    """A buffer written by the first training forward only (a data-dependent init), which the first shape refuses,
    and a V-sized logits buffer, on which the cut second shape fails and falls back to the whole model."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(8))
        self.register_buffer("initialised", torch.zeros((), dtype=torch.bool))

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        if self.training and not bool(self.initialised):
            with torch.no_grad():
                self.scale.copy_(1 / (h.std(dim=(0, 1)) + 1e-6))
                self.initialised.fill_(True)
        return self.head(torch.tanh(self.body(h * self.scale))) + self.final_logits_bias


def test_the_fallback_to_the_whole_model_keeps_what_the_first_shape_found():
    """Red team (session 24): the fallback reset the report, so a finding of the first shape that does not repeat
    (a buffer written once) was forgotten and the model accepted."""
    with pytest.raises(UserError, match="buffer 'scale'"):
        engine_for(WrittenOnce().train()).verify()


def test_a_tied_scaled_embedding_is_cut_with_its_head():
    """Gemma's embedding is an ``nn.Embedding`` subclass that scales its output, tied to the head."""
    import transformers

    config = transformers.GemmaConfig(vocab_size=261, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      tie_word_embeddings=True)
    model = transformers.GemmaForCausalLM(config).train()
    embedding = model.get_input_embeddings()
    assert type(embedding) is not nn.Embedding and embedding.weight is model.lm_head.weight
    cut = plan_vocabulary_cut(model, config.vocab_size, rows=16)
    assert (embedding, "num_embeddings") in cut.sizes and cut.params == [model.lm_head.weight]
    report = engine_for(model).verify()
    assert not report.notes and {row.status for row in report.rows.values()} == {"exact"}


def test_a_task_batch_is_drawn_below_the_cut_and_one_with_an_id_beyond_it_runs_on_the_whole_vocabulary(
        monkeypatch):
    """Tasks draw their probe ids from the model's vocabulary size (``tasks.probe_batches.vocab_size``), read
    under the cut; a batch holding a fixed id at or beyond it (a special token) runs the shape uncut."""
    from dptext.privacy import causal_lm_loss
    from dptext.tasks.probe_batches import token_batch, vocab_size

    def loss(model, batch):
        return causal_lm_loss(model(**batch).logits, batch["input_ids"], batch["attention_mask"])

    real = verify.probe_one
    for special in (None, 200):
        model = llama()
        seen = []
        def recording(engine, report, batch, *rest, model=model, seen=seen):
            seen.append((model.lm_head.weight.shape[0], int(batch["input_ids"].max())))
            return real(engine, report, batch, *rest)

        monkeypatch.setattr(verify, "probe_one", recording)

        def make_batch(examples, positions, generator, special=special):
            batch = token_batch(vocab_size(model), generator, examples, positions)
            if special is not None:
                batch["input_ids"][:, 0] = special
            return batch

        report = engine_for(model).verify(make_batch=make_batch, loss_fn=loss)
        assert {row.status for row in report.rows.values()} == {"exact"} and not report.notes
        rows = 2 * model.config.hidden_size
        if special is None:
            assert seen[1][0] == rows and seen[1][1] < rows
        else:
            assert seen[1][0] == model.config.vocab_size and seen[1][1] >= special


def test_the_probe_of_the_suites_models_cuts_their_vocabulary():
    """The conftest's 16 rows are what every default-batch probe in the suite runs its second shape on."""
    model = llama()
    assert plan_vocabulary_cut(model, model.config.vocab_size) is not None


class BatchCoupledBackward(torch.autograd.Function):
    """Identity forward; a backward that divides the activation gradients by the batch's RMS (a batch-wide
    statistic) or rolls them among examples 1.. (example 0 untouched)."""

    @staticmethod
    def forward(ctx, hidden, kind):
        ctx.kind = kind
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        if ctx.kind == "roll":
            grad = grad.clone()
            grad[1:] = grad[1:].roll(1, 0)
            return grad, None
        return grad / (grad.pow(2).mean().sqrt() + 1e-12), None


class CoupledBlock(nn.Module):
    def __init__(self, width, layer_idx, coupled, kind):
        super().__init__()
        self.layer_idx, self.coupled, self.kind = layer_idx, coupled, kind  # ``coupled``: the same list in every
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)  # block, as config lists are

    def forward(self, hidden):
        hidden = hidden + self.down(torch.tanh(self.up(hidden)))
        return BatchCoupledBackward.apply(hidden, self.kind) if self.coupled[self.layer_idx] else hidden


class CoupledAtDepth(nn.Module):
    """Four equal blocks (the stack cut keeps the first); only the last couples the batch, in its backward."""

    def __init__(self, kind, vocab=50, width=8, layers=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        coupled = [False] * (layers - 1) + [True]
        self.layers = nn.ModuleList(CoupledBlock(width, i, coupled, kind) for i in range(layers))
        self.head = nn.Linear(width, vocab)

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask=None):
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.head(hidden)


@pytest.mark.parametrize("kind", ["rms", "roll"])
def test_a_backward_that_couples_the_batch_at_a_depth_the_cut_removes_is_refused(kind):
    """Red team (session 24): with one example carrying gradient in the whole-model shape (tried, reverted), both
    were accepted and training's clipped sums were off by 34-173%; two examples carry gradient there."""
    with pytest.raises(UserError, match="refused layer"):
        engine_for(CoupledAtDepth(kind).train()).verify()


class NoTokenEmbeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.out = nn.Linear(6, 1)

    def get_input_embeddings(self):  # what transformers' default does on a model without token embeddings
        raise NotImplementedError("`get_input_embeddings` not auto-handled")

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)[..., 0]


def test_a_model_without_token_embeddings_is_probed_without_a_vocabulary_cut():
    report = engine_for(NoTokenEmbeddings().train()).verify(
        make_batch=lambda examples, positions, generator: {"x": torch.randn(examples, positions, 6,
                                                                            generator=generator)},
        loss_fn=lambda model, batch: model(batch["x"]).pow(2).sum(1))
    assert {row.status for row in report.rows.values()} == {"exact"}


def test_the_users_own_gradients_on_the_cut_matrices_are_given_back():
    model = llama()
    engine = engine_for(model)
    engine.detach()
    own = torch.ones_like(model.lm_head.weight)
    model.lm_head.weight.grad = own
    report = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.0,
                           max_grad_norm=0.05, expected_batch_size=4, dataset_size=100, verify=False).verify()
    assert {row.status for row in report.rows.values()} == {"exact"}
    assert model.lm_head.weight.grad is own
