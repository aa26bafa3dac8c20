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
    from sacrebleu.metrics import BLEU  # only generation tasks score BLEU / ROUGE; the scorers load slowly

    _check_aligned(hypotheses, references)
    if not hypotheses:
        return 0.0
    width = max(len(refs) for refs in references)
    streams = [[refs[k] if k < len(refs) else None for refs in references] for k in range(width)]
    return float(BLEU().corpus_score(list(hypotheses), streams).score)


def rouge_l(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """ROUGE-L F1, best reference per hypothesis, averaged over hypotheses."""
    from rouge_score import rouge_scorer  # only generation tasks score BLEU / ROUGE; the scorers load slowly

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


# ---------------------------------------------------------------------------- intent classification + slot filling

def bio_spans(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """(type, start, end) slot spans of one BIO tag sequence, end exclusive, as conlleval reads them.

    A span starts at ``B-X``, or at ``I-X`` that does not continue a span of type X (conlleval's rule for
    an I- after O or after another type); it ends before the next O, B- or I- of another type."""
    spans, start, kind = [], None, None
    for position, tag in enumerate(list(tags) + ["O"]):
        prefix, _, label = tag.partition("-")
        continues = prefix == "I" and kind == label
        if start is not None and not continues:
            spans.append((kind, start, position))
            start, kind = None, None
        if prefix in ("B", "I") and not continues:
            start, kind = position, label
    return spans


def slot_f1(predicted: Sequence[Sequence[str]], reference: Sequence[Sequence[str]]) -> float:
    """Span-level micro F1 over the corpus (conlleval): a slot counts only with its exact type and boundaries."""
    if len(predicted) != len(reference):
        raise ValueError(f"{len(predicted)} predicted tag sequences but {len(reference)} references")
    correct = found = expected = 0
    for hyp, ref in zip(predicted, reference):
        hyp_spans, ref_spans = Counter(bio_spans(hyp)), Counter(bio_spans(ref))
        correct += sum((hyp_spans & ref_spans).values())
        found += sum(hyp_spans.values())
        expected += sum(ref_spans.values())
    if correct == 0:
        return 0.0 if found or expected else 100.0  # nothing to find and nothing found: perfect
    precision, recall = correct / found, correct / expected
    return 100.0 * 2 * precision * recall / (precision + recall)


def slot_values(tokens: Sequence[str], tags: Sequence[str]) -> list[tuple[str, str]]:
    """The (slot type, value) pairs of one utterance, the value being the span's words joined by spaces."""
    return [(kind, " ".join(tokens[start:end])) for kind, start, end in bio_spans(tags)]


def semantic_errors(predicted_intent: str, reference_intent: str, predicted_slots: Sequence[tuple[str, str]],
                    reference_slots: Sequence[tuple[str, str]]) -> tuple[int, int]:
    """(errors, reference items) of one utterance, the intent counted as one more item.

    Slots are matched as a multiset of (type, value) pairs. Of the unmatched ones, a reference and a
    predicted slot of the same type pair up as one substitution (right type, wrong value); the rest are
    deletions (reference slots left over) or insertions (predicted slots left over). A wrong intent is one
    substitution."""
    hyp, ref = Counter(predicted_slots), Counter(reference_slots)
    matched = hyp & ref
    hyp_left, ref_left = hyp - matched, ref - matched
    hyp_types, ref_types = Counter(t for t, _ in hyp_left.elements()), Counter(t for t, _ in ref_left.elements())
    substitutions = sum((hyp_types & ref_types).values())
    deletions = sum(ref_left.values()) - substitutions
    insertions = sum(hyp_left.values()) - substitutions
    errors = substitutions + deletions + insertions + int(predicted_intent != reference_intent)
    return errors, sum(ref.values()) + 1


def semantic_error_rate(predicted_intents: Sequence[str], reference_intents: Sequence[str],
                        predicted_slots: Sequence[Sequence[tuple[str, str]]],
                        reference_slots: Sequence[Sequence[tuple[str, str]]]) -> float:
    """SER in percent: Σ (slot S + D + I + intent errors) / Σ (reference slots + 1), over the whole corpus."""
    sizes = {len(predicted_intents), len(reference_intents), len(predicted_slots), len(reference_slots)}
    if len(sizes) != 1:
        raise ValueError("predicted and reference intents and slots must have one entry per utterance")
    errors = items = 0
    for hyp_intent, ref_intent, hyp, ref in zip(predicted_intents, reference_intents, predicted_slots,
                                                 reference_slots):
        utterance_errors, utterance_items = semantic_errors(hyp_intent, ref_intent, hyp, ref)
        errors += utterance_errors
        items += utterance_items
    return 100.0 * errors / items if items else 0.0
