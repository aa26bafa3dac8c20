"""DP decoding on the real offline SmolLM2-135M (slow: not in the default run)."""

from __future__ import annotations

import csv

import pytest

from dptext.decoding import dp_generate, perplexity_sweep
from dptext.decoding.benchmark import benchmark_overhead
from dptext.decoding.loading import load_for_decoding

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer, kind = load_for_decoding("smollm2-135m", "cpu")
    assert kind == "causal_lm"
    return model, tokenizer


def e2e_references(shared_data, count):
    seen, refs = set(), []
    with open(shared_data / "e2e_nlg" / "testset_w_refs.csv", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            if row["mr"] not in seen:  # one reference per meaning representation
                seen.add(row["mr"])
                refs.append(row["ref"].strip())
            if len(refs) == count:
                return refs
    return refs


def test_perplexity_falls_as_lambda_grows(smollm2, shared_data):
    model, tokenizer = smollm2
    result = perplexity_sweep(model, tokenizer, "causal_lm", e2e_references(shared_data, 40), [0.0, 0.3, 0.6, 0.9, 1.0])
    perplexities = [row.perplexity for row in result.rows]
    assert perplexities[0] == pytest.approx(49_152, rel=1e-9)  # λ = 0: |V| = SmolLM2's output dimension
    assert perplexities == sorted(perplexities, reverse=True)
    assert result.baseline_perplexity < 300  # a trained model, far from uniform


def test_generation_on_smollm2(smollm2):
    model, tokenizer = smollm2
    out = dp_generate(model, tokenizer, "The restaurant near the river", lam=0.9, max_new_tokens=8, seed=0)
    assert out.support_size == 49_152 and len(out.token_ids[0]) == 8


def test_perturbation_is_a_small_share_of_generation_time(smollm2):
    model, tokenizer = smollm2
    result = benchmark_overhead(model, tokenizer, new_tokens=32, repeats=3)
    # the end-to-end ratio is noisy on a shared machine; the in-process share is not
    assert result["processor_share"] < 0.05, result
