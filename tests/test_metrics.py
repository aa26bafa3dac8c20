"""Metrics against direct library calls and hand-computed values."""

from __future__ import annotations

import math

import pytest
from rouge_score import rouge_scorer
from sacrebleu.metrics import BLEU

from dptext import metrics


def test_bleu_is_sacrebleu_with_all_references():
    hyps = ["the vaults is a cheap pub near cafe adriatic", "blue spice is a coffee shop"]
    refs = [["The Vaults is a pub near Café Adriatic.", "the vaults is a cheap pub near cafe adriatic"],
            ["Blue Spice is a coffee shop in the city centre."]]
    expected = BLEU().corpus_score(hyps, [[refs[0][0], refs[1][0]], [refs[0][1], None]]).score
    assert metrics.corpus_bleu(hyps, refs) == pytest.approx(expected)
    # a second reference can only help
    assert metrics.corpus_bleu(hyps, refs) > metrics.corpus_bleu(hyps, [refs[0][:1], refs[1]])


def test_bleu_perfect_and_empty():
    assert metrics.corpus_bleu(["a b c d e"], [["a b c d e"]]) == pytest.approx(100.0)
    assert metrics.corpus_bleu([], []) == 0.0
    with pytest.raises(ValueError):
        metrics.corpus_bleu(["x"], [[]])


def test_rouge_l_takes_the_best_reference():
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    hyp, refs = "a pub in the city centre", ["a coffee shop by the river", "a pub in the centre of the city"]
    best = max(scorer.score(r, hyp)["rougeL"].fmeasure for r in refs)
    assert metrics.rouge_l([hyp], [refs]) == pytest.approx(100 * best)


def test_token_f1_hand_computed():
    # hyp words: i like green apples ; ref words: i like red apples too -> common 3, P=3/4, R=3/5
    assert metrics.token_f1("I like green apples.", "i like the red apples too") == pytest.approx(2 * 0.75 * 0.6 / 1.35)
    assert metrics.token_f1("", "anything") == 0.0
    assert metrics.mean_token_f1(["same words"], ["same words"]) == pytest.approx(100.0)


def test_accuracy_and_perplexity():
    assert metrics.accuracy([1, 0, 1, 1], [1, 1, 1, 0]) == 50.0
    assert metrics.perplexity(total_nll=4 * math.log(10), total_tokens=4) == pytest.approx(10.0)
    with pytest.raises(ValueError):
        metrics.perplexity(1.0, 0)
