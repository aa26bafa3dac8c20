"""Evaluation metrics as pure functions over strings and numbers (no models).

Generation metrics compare each hypothesis against *all* references of its input, as the
E2E and DART evaluations do: corpus BLEU from sacrebleu (variable reference counts are
padded with ``None``, which sacrebleu ignores) and ROUGE-L F-measure from rouge-score
(the best-matching reference per hypothesis, averaged). Scores are on a 0–100 scale.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from typing import Sequence


def _check_aligned(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> None:
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} reference lists")
    if any(len(refs) == 0 for refs in references):
        raise ValueError("every hypothesis needs at least one reference")


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Multi-reference corpus BLEU (sacrebleu defaults: 13a tokenisation, 4-grams)."""
    from sacrebleu.metrics import BLEU

    _check_aligned(hypotheses, references)
    if not hypotheses:
        return 0.0
    width = max(len(refs) for refs in references)
    streams = [[refs[k] if k < len(refs) else None for refs in references] for k in range(width)]
    return float(BLEU().corpus_score(list(hypotheses), streams).score)


def rouge_l(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """ROUGE-L F1, best reference per hypothesis, averaged over hypotheses."""
    from rouge_score import rouge_scorer

    _check_aligned(hypotheses, references)
    if not hypotheses:
        return 0.0
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    best = [max(scorer.score(ref, hyp)["rougeL"].fmeasure for ref in refs) for hyp, refs in zip(hypotheses, references)]
    return 100.0 * sum(best) / len(best)


def _normalise_words(text: str) -> list[str]:
    """SQuAD/ParlAI-style normalisation: lower case, no punctuation or articles."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return text.split()


def token_f1(hypothesis: str, reference: str) -> float:
    """Unigram F1 between two strings (the dialog metric of ParlAI / Persona-Chat)."""
    hyp, ref = _normalise_words(hypothesis), _normalise_words(reference)
    common = sum((Counter(hyp) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(hyp), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def mean_token_f1(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not hypotheses:
        return 0.0
    return 100.0 * sum(token_f1(h, r) for h, r in zip(hypotheses, references)) / len(hypotheses)


def accuracy(predictions: Sequence[int], labels: Sequence[int]) -> float:
    if len(predictions) != len(labels):
        raise ValueError(f"{len(predictions)} predictions but {len(labels)} labels")
    if not labels:
        return 0.0
    return 100.0 * sum(int(p == y) for p, y in zip(predictions, labels)) / len(labels)


def perplexity(total_nll: float, total_tokens: int) -> float:
    """exp of the mean negative log-likelihood per token (natural log)."""
    if total_tokens <= 0:
        raise ValueError("perplexity needs at least one token")
    return math.exp(total_nll / total_tokens)
