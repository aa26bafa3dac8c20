"""The DP logits processor inside real ``model.generate`` and masked-LM filling, on tiny models."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from dptext.decoding import (
    DPSamplingLogitsProcessor,
    PrivacyViolation,
    PublicSupport,
    dp_fill_masks,
    dp_generate,
    epsilon_for_lambda,
)
from dptext.errors import UserError
from dptext.models import load_model

V = 261  # the tiny models' byte-level vocabulary = their output dimension


def q_prime_of_next_token(model, tokenizer, prompt, lam, temperature=1.0):
    """Brute force: the model's next-token softmax mixed with uniform, in float64."""
    with torch.no_grad():
        logits = model(**tokenizer(prompt, return_tensors="pt")).logits[0, -1].double()
    return lam * torch.softmax(logits / temperature, -1) + (1 - lam) / logits.shape[-1]


def assert_frequencies_match(samples: torch.Tensor, expected: torch.Tensor):
    observed = torch.bincount(samples.flatten(), minlength=expected.numel()).double()
    result = chisquare(observed.numpy(), (expected / expected.sum() * observed.sum()).numpy())
    assert result.pvalue > 1e-3, result


def test_generate_samples_the_first_token_from_q_prime(gpt2):
    model, tokenizer = gpt2
    draws = 5000  # expected count of the rarest token: 5000 · 0.5/261 ≈ 10
    out = dp_generate(model, tokenizer, ["Hello"] * draws, lam=0.5, max_new_tokens=1, temperature=2.0, seed=0)
    first = torch.tensor([ids[0] for ids in out.token_ids])
    assert_frequencies_match(first, q_prime_of_next_token(model, tokenizer, "Hello", 0.5, temperature=2.0))
    assert out.epsilons[0] == pytest.approx(epsilon_for_lambda(0.5, V, 1))
    assert out.support_size == V and out.tokens == [1] * draws


def test_lambda_zero_generates_uniform_tokens_at_every_step(gpt2):
    model, tokenizer = gpt2
    out = dp_generate(model, tokenizer, ["Hi"] * 600, lam=0.0, max_new_tokens=10, seed=1)
    sampled = []
    for ids in out.token_ids:  # tokens up to and including the first EOS were sampled
        end = ids.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in ids else len(ids)
        sampled.extend(ids[:end])
    assert len(sampled) > 5000
    assert_frequencies_match(torch.tensor(sampled), torch.ones(V, dtype=torch.float64))
    assert out.epsilons[0] == 0.0


def test_hostile_generation_config_cannot_truncate_the_support(gpt2):
    model, tokenizer = gpt2
    saved = model.generation_config.to_dict()
    try:
        for key, value in dict(top_k=5, top_p=0.5, min_p=0.3, temperature=0.2, typical_p=0.5, epsilon_cutoff=0.01,
                               eta_cutoff=0.01, renormalize_logits=True, do_sample=False, num_beams=3,
                               prompt_lookup_num_tokens=3, dola_layers="high", penalty_alpha=0.6,
                               force_words_ids=[[5]]).items():
            setattr(model.generation_config, key, value)
        out = dp_generate(model, tokenizer, ["Hi"] * 500, lam=0.0, max_new_tokens=1, seed=2)
    finally:
        for key, value in saved.items():
            setattr(model.generation_config, key, value)
    assert len({ids[0] for ids in out.token_ids}) > 100  # uniform over 261, not a top-5


def test_verify_catches_a_warper_after_the_processor(gpt2):
    model, tokenizer = gpt2
    processor = DPSamplingLogitsProcessor(0.5, V, keep_outputs=True)
    # plain generate(do_sample=True) applies top_k=50 by default, after custom processors
    result = model.generate(**tokenizer(["Hello"], return_tensors="pt"), do_sample=True, max_new_tokens=2,
                            logits_processor=[processor], return_dict_in_generate=True, output_scores=True,
                            pad_token_id=tokenizer.pad_token_id)
    with pytest.raises(PrivacyViolation):
        processor.verify(result.scores)
    fine = DPSamplingLogitsProcessor(0.5, V, keep_outputs=True)
    result = model.generate(**tokenizer(["Hello"], return_tensors="pt"), max_new_tokens=2, logits_processor=[fine],
                            return_dict_in_generate=True, output_scores=True, pad_token_id=tokenizer.pad_token_id,
                            **fine.generate_kwargs())
    fine.verify(result.scores)


def test_processor_refuses_a_different_vocabulary_size():
    with pytest.raises(PrivacyViolation):
        DPSamplingLogitsProcessor(0.5, 100)(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, V))


@pytest.mark.parametrize("setting", [dict(do_sample=False), dict(num_beams=4), dict(top_k=50), dict(top_p=0.9),
                                     dict(min_p=0.1), dict(penalty_alpha=0.6), dict(stopping_criteria=[]),
                                     dict(assistant_model=None), dict(renormalize_logits=True)])
def test_greedy_beam_and_private_truncation_are_refused(gpt2, setting):
    model, tokenizer = gpt2
    with pytest.raises(UserError):
        dp_generate(model, tokenizer, "Hi", lam=0.5, max_new_tokens=2, **setting)


@pytest.mark.parametrize("lam", [1.0, -0.2, 2.0])
def test_lambda_outside_the_private_range_is_refused(gpt2, lam):
    model, tokenizer = gpt2
    with pytest.raises(UserError):
        dp_generate(model, tokenizer, "Hi", lam=lam, max_new_tokens=2)


def test_public_top_k_support(gpt2):
    model, tokenizer = gpt2
    public_model, public_tokenizer = load_model("tiny-llama")
    with torch.no_grad():
        public_top = set(public_model(**tokenizer("Hello", return_tensors="pt")).logits[0, -1].topk(5).indices.tolist())
    out = dp_generate(model, tokenizer, ["Hello"] * 300, lam=0.0, max_new_tokens=3, seed=3,
                      public=PublicSupport(public_model, public_tokenizer, top_k=5))
    assert {ids[0] for ids in out.token_ids} == public_top  # λ = 0: uniform over the public top-5 exactly
    assert out.support_size == 5
    assert out.epsilons[0] == 0.0
    out = dp_generate(model, tokenizer, "Hello", lam=0.5, max_new_tokens=3, seed=3,
                      public=PublicSupport(public_model, public_tokenizer, top_k=5))
    assert out.epsilons[0] == pytest.approx(3 * math.log((1 + 4 * 0.5) / 0.5))


def test_public_model_with_another_vocabulary_is_refused(gpt2):
    model, tokenizer = gpt2
    other_model, other_tokenizer = load_model("tiny-llama")
    other_model.resize_token_embeddings(300)
    with pytest.raises(UserError, match="vocabulary"):
        dp_generate(model, tokenizer, "Hi", lam=0.5, max_new_tokens=2,
                    public=PublicSupport(other_model, other_tokenizer, top_k=5))


def test_mask_filling_samples_from_q_prime(roberta):
    model, tokenizer = roberta
    text = f"a{tokenizer.mask_token}b"
    draws = 6000  # expected count of the rarest token: 6000 · 0.3/261 ≈ 7
    out = dp_fill_masks(model, tokenizer, [text] * draws, lam=0.7, seed=4)
    with torch.no_grad():
        batch = tokenizer(text, return_tensors="pt")
        logits = model(**batch).logits[0][batch["input_ids"][0] == tokenizer.mask_token_id][0].double()
    expected = 0.7 * torch.softmax(logits, -1) + 0.3 / V
    assert_frequencies_match(torch.tensor([ids[0] for ids in out.token_ids]), expected)
    two = dp_fill_masks(model, tokenizer, f"{tokenizer.mask_token} and {tokenizer.mask_token}", lam=0.7, seed=4)
    assert two.tokens == [2] and two.epsilons[0] == pytest.approx(epsilon_for_lambda(0.7, V, 2))


def test_mask_filling_needs_a_mask(roberta):
    model, tokenizer = roberta
    with pytest.raises(UserError, match="mask"):
        dp_fill_masks(model, tokenizer, "no mask here", lam=0.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_same_distribution_on_gpu(gpt2):
    logits = torch.randn(4, V)
    on_gpu = DPSamplingLogitsProcessor(0.7, V)(None, logits.cuda()).cpu()
    assert torch.allclose(on_gpu, DPSamplingLogitsProcessor(0.7, V)(None, logits), atol=1e-6)
    model, tokenizer = gpt2
    out = dp_generate(model.cuda(), tokenizer, ["Hi"] * 4, lam=0.5, max_new_tokens=3, seed=0)
    model.cpu()
    assert len(out.token_ids) == 4 and out.support_size == V
