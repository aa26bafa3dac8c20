"""Model loading: offline aliases, tiny test configs, and clear errors for missing models."""

from __future__ import annotations

import math

import pytest
import torch

from dptext import models
from dptext.errors import UserError

ENGLISH = [
    "The weather was lovely today, so we went for a long walk in the park.",
    "She opened the door and saw that the package had finally arrived.",
    "Most restaurants in the city centre close at ten in the evening.",
]


@pytest.mark.parametrize(
    "name, head, tied",
    [
        ("tiny-gpt2", "causal_lm", ("transformer.wte.weight", "lm_head.weight")),
        ("tiny-llama", "causal_lm", ("model.embed_tokens.weight", "lm_head.weight")),
        ("tiny-bert", "masked_lm", ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight")),
        ("tiny-roberta", "masked_lm", ("roberta.embeddings.word_embeddings.weight", "lm_head.decoder.weight")),
    ],
)
def test_tiny_models_are_tied_deterministic_and_run(name, head, tied):
    model, tokenizer = models.load_model(name, head=head)
    again, _ = models.load_model(name, head=head)
    params = dict(model.named_parameters(remove_duplicate=False))
    assert params[tied[0]] is params[tied[1]], "tiny models must keep tied embeddings"
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    assert sum(p.numel() for p in model.parameters()) < 100_000
    batch = tokenizer(["héllo wörld", "a"], return_tensors="pt", padding=True)
    assert tokenizer.decode(tokenizer("héllo wörld", add_special_tokens=False)["input_ids"]) == "héllo wörld"
    logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_tiny_classification_head():
    model, tokenizer = models.load_model("tiny-bert", head="sequence_classification", num_labels=3)
    logits = model(**tokenizer(["good", "bad"], return_tensors="pt", padding=True)).logits
    assert logits.shape == (2, 3)


def test_minilm_loads_as_encoder_and_classifier():
    encoder, tokenizer = models.load_model("minilm-l6", head="base")
    assert sum(p.numel() for p in encoder.parameters()) == pytest.approx(22.7e6, rel=0.01)
    batch = tokenizer(ENGLISH, return_tensors="pt", padding=True)
    assert encoder(**batch).last_hidden_state.shape[-1] == 384
    classifier, _ = models.load_model("minilm-l6", head="sequence_classification", num_labels=2)
    assert classifier(**batch).logits.shape == (3, 2)


def test_minilm_refuses_a_masked_lm_head():
    with pytest.raises(UserError, match="no pretrained masked-LM head"):
        models.load_model("minilm-l6", head="masked_lm")


def test_smollm2_is_a_real_language_model():
    model, tokenizer = models.load_model("smollm2-135m", head="causal_lm")
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    losses = []
    with torch.no_grad():
        for sentence in ENGLISH:
            ids = tokenizer(sentence, return_tensors="pt")["input_ids"]
            losses.append(model(input_ids=ids, labels=ids).loss.item())
    perplexity = math.exp(sum(losses) / len(losses))
    assert perplexity < 100, f"perplexity {perplexity:.0f}: a broken GGUF conversion gives thousands"


def test_missing_local_folder_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        models.load_model(str(tmp_path / "nope"))


def test_unreachable_hub_name_is_a_user_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # fail fast instead of retrying the network: the variable is read
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # at import, so set the constant too
    with pytest.raises(UserError, match="offline alias"):
        models.load_tokenizer("gpt2-this-model-does-not-exist")


def test_unknown_head_is_a_user_error():
    with pytest.raises(UserError, match="Unknown model head"):
        models.load_model("tiny-gpt2", head="seq2seq")


def test_local_folder_round_trip(tmp_path):
    model, tokenizer = models.load_model("tiny-llama")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tok = models.load_model(str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), loaded.parameters()))
    assert loaded_tok("abc")["input_ids"] == tokenizer("abc")["input_ids"]


def test_describe_lists_every_alias():
    names = {row["name"] for row in models.describe_models()}
    assert names == set(models.OFFLINE_MODELS) | set(models.TINY_MODELS)
