"""Perplexity sweeps under q' on tiny models: values against brute force, the MLM protocol, inputs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dptext.decoding import epsilon_for_lambda, parse_lambdas, perplexity_sweep, plot_sweep, read_texts
from dptext.decoding.sweep import MASK_FRACTION
from dptext.errors import UserError

TEXTS = ["The cat sat on the mat.", "Blue Spice is a coffee shop.", "Hi", "A longer sentence, with commas."]
V = 261


def brute_force_causal_perplexity(model, tokenizer, texts, lam):
    """Corpus per-token perplexity, one text at a time, from the full q' of each position."""
    total, count = 0.0, 0
    for text in texts:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            q = torch.softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
        q_prime = lam * q + (1 - lam) / q.shape[-1]
        total -= q_prime.gather(-1, ids[0, 1:, None]).log().sum().item()
        count += ids.shape[1] - 1
    return math.exp(total / count), count


def test_causal_sweep_matches_brute_force(gpt2):
    model, tokenizer = gpt2
    result = perplexity_sweep(model, tokenizer, "causal_lm", TEXTS, [0.0, 0.5, 1.0], batch_size=3)
    for row in result.rows:
        expected, count = brute_force_causal_perplexity(model, tokenizer, TEXTS, row.lam)
        assert row.perplexity == pytest.approx(expected, rel=1e-5)
    assert result.predicted_tokens == count
    assert result.tokens_per_example == pytest.approx(count / len(TEXTS))
    by_lam = {row.lam: row for row in result.rows}
    assert by_lam[0.0].perplexity == pytest.approx(V, rel=1e-12)  # λ = 0: uniform, perplexity |V|
    assert by_lam[1.0].relative_increase == 0.0 and by_lam[1.0].epsilon == math.inf
    assert by_lam[0.5].epsilon == pytest.approx(epsilon_for_lambda(0.5, V, count / len(TEXTS)))


def test_lambda_one_perplexity_is_the_models_own_loss(gpt2):
    model, tokenizer = gpt2
    ids = tokenizer(TEXTS[0], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    result = perplexity_sweep(model, tokenizer, "causal_lm", TEXTS[:1], [1.0])
    assert result.rows[0].perplexity == pytest.approx(math.exp(loss), rel=1e-5)


def test_masked_lm_protocol(roberta):
    model, tokenizer = roberta
    result = perplexity_sweep(model, tokenizer, "masked_lm", TEXTS, [0.0, 0.8, 1.0], batch_size=2, seed=7)
    lengths = [len(tokenizer(t)["input_ids"]) - 2 for t in TEXTS]  # minus <s> and </s>
    masked_per_example = [max(1, round(MASK_FRACTION * n)) for n in lengths]
    assert result.maskings == 3
    assert result.predicted_tokens == 3 * sum(masked_per_example)
    average_masked = sum(masked_per_example) / len(TEXTS)
    assert result.tokens_per_example == pytest.approx(average_masked)  # T = average masked tokens per example
    by_lam = {row.lam: row for row in result.rows}
    assert by_lam[0.8].epsilon == pytest.approx(epsilon_for_lambda(0.8, V, average_masked))
    assert by_lam[0.0].perplexity == pytest.approx(V, rel=1e-12)
    assert by_lam[1.0].perplexity == result.baseline_perplexity
    again = perplexity_sweep(model, tokenizer, "masked_lm", TEXTS, [0.8], batch_size=4, seed=7)
    assert again.rows[0].perplexity == pytest.approx(by_lam[0.8].perplexity, rel=1e-6)  # batching changes nothing


def test_plot_is_a_png(gpt2, tmp_path):
    model, tokenizer = gpt2
    result = perplexity_sweep(model, tokenizer, "causal_lm", TEXTS, parse_lambdas("0:1:0.5"))
    path = plot_sweep(result, tmp_path / "sub" / "sweep.png")
    assert path.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("spec,expected", [("0.1:1.0:0.1", [round(0.1 * i, 10) for i in range(1, 11)]),
                                           ("0.9, 0,0.5", [0.0, 0.5, 0.9]), ("1", [1.0]),
                                           ("0:0.3:0.1", [0, .1, .2, .3])])
def test_parse_lambdas(spec, expected):
    assert parse_lambdas(spec) == pytest.approx(expected)


@pytest.mark.parametrize("spec", ["0:1", "a,b", "0:1:0", "0.5,1.5", "-0.1", ""])
def test_parse_lambdas_refuses_bad_specs(spec):
    with pytest.raises(UserError):
        parse_lambdas(spec)


def test_read_texts(tmp_path):
    plain = tmp_path / "held_out.txt"
    plain.write_text("first line\n\nsecond line\nthird\n")
    assert read_texts(plain) == ["first line", "second line", "third"]
    assert read_texts(plain, max_examples=2) == ["first line", "second line"]
    records = tmp_path / "held_out.jsonl"
    records.write_text("\n".join(json.dumps({"text": f"t{i}", "ref": f"r{i}"}) for i in range(3)) + "\n")
    assert read_texts(records) == ["t0", "t1", "t2"]
    assert read_texts(records, text_column="ref") == ["r0", "r1", "r2"]
    with pytest.raises(UserError, match="--text-column"):
        read_texts(records, text_column="body")
    with pytest.raises(UserError, match="does not exist"):
        read_texts(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(UserError, match="no examples"):
        read_texts(tmp_path / "empty.txt")
