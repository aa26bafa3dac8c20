"""Intent/slot metrics: BIO spans (conlleval), slot F1, SER — hand-computed values and independent twins."""

from __future__ import annotations

import itertools
import random

import pytest

from dptext import metrics


# ---------------------------------------------------------------------------- BIO spans against conlleval's rules

def conlleval_chunks(tags: list[str]) -> list[tuple[str, int, int]]:
    """A port of conlleval.pl's startOfChunk / endOfChunk (IOB2 tags only): the independent twin of bio_spans."""
    def split(tag):
        return ("O", "") if tag == "O" else tuple(tag.split("-", 1))

    chunks, start = [], None
    prev_tag, prev_type = "O", ""
    for position, full in enumerate(tags + ["O"]):
        tag, kind = split(full)
        end = (prev_tag in ("B", "I") and tag in ("B", "O")) or (prev_tag != "O" and prev_type != kind)
        begin = tag == "B" or (prev_tag == "O" and tag == "I") or (tag != "O" and prev_type != kind)
        if end and start is not None:
            chunks.append((prev_type, start, position))
            start = None
        if begin:
            start = position
        prev_tag, prev_type = tag, kind
    return chunks


def test_bio_spans_hand_computed():
    tags = "B-a I-a O I-b I-b B-b I-a".split()
    assert metrics.bio_spans(tags) == [("a", 0, 2), ("b", 3, 5), ("b", 5, 6), ("a", 6, 7)]
    assert metrics.bio_spans([]) == [] and metrics.bio_spans(["O", "O"]) == []
    assert metrics.bio_spans(["B-a", "B-a"]) == [("a", 0, 1), ("a", 1, 2)]


def test_bio_spans_match_conlleval_on_random_sequences():
    rng = random.Random(0)
    alphabet = ["O", "B-a", "I-a", "B-b", "I-b"]
    for _ in range(2000):
        tags = [rng.choice(alphabet) for _ in range(rng.randint(0, 8))]
        assert metrics.bio_spans(tags) == conlleval_chunks(tags), tags


# ---------------------------------------------------------------------------- slot F1

def test_slot_f1_hand_computed():
    reference = [["B-x", "I-x", "O", "B-y"], ["O", "B-z"]]
    # utterance 1: x span right, y missed; utterance 2: z found but with the wrong boundary (one span too long)
    predicted = [["B-x", "I-x", "O", "O"], ["B-z", "I-z"]]
    # found 2, expected 3, correct 1: P = 1/2, R = 1/3, F1 = 2·(1/6)/(5/6) = 0.4
    assert metrics.slot_f1(predicted, reference) == pytest.approx(40.0)
    assert metrics.slot_f1(reference, reference) == pytest.approx(100.0)
    assert metrics.slot_f1([["O"]], [["O"]]) == 100.0  # nothing to find, nothing found
    assert metrics.slot_f1([["B-x"]], [["O"]]) == 0.0
    with pytest.raises(ValueError):
        metrics.slot_f1([["O"]], [])


# ---------------------------------------------------------------------------- SER

def brute_force_slot_errors(predicted, reference) -> int:
    """Minimum edit cost over every pairing of reference slots with predicted slots: an exact pair costs 0,
    a same-type pair 1 (substitution), a different-type pair 2 (a deletion plus an insertion), an unpaired slot 1."""
    best = len(predicted) + len(reference)
    hyp_slots = list(range(len(predicted)))
    for size in range(min(len(predicted), len(reference)) + 1):
        for refs in itertools.combinations(range(len(reference)), size):
            for hyps in itertools.permutations(hyp_slots, size):
                cost = len(predicted) + len(reference) - 2 * size
                for r, h in zip(refs, hyps):
                    (rt, rv), (ht, hv) = reference[r], predicted[h]
                    cost += 0 if (rt, rv) == (ht, hv) else 1 if rt == ht else 2
                best = min(best, cost)
    return best


def test_semantic_errors_hand_computed():
    boston, denver = ("toloc", "boston"), ("toloc", "denver")
    # perfect: no errors over 2 slots + 1 intent
    assert metrics.semantic_errors("flight", "flight", [boston, ("fromloc", "dallas")],
                                   [("fromloc", "dallas"), boston]) == (0, 3)
    # wrong intent only: one substitution
    assert metrics.semantic_errors("airfare", "flight", [boston], [boston]) == (1, 2)
    # no reference slots, one inserted, intent right
    assert metrics.semantic_errors("flight", "flight", [boston], []) == (1, 1)
    # no slots on either side, wrong intent: SER 100% for this utterance
    assert metrics.semantic_errors("a", "b", [], []) == (1, 1)
    # duplicate slot types: right type, wrong value = one substitution
    assert metrics.semantic_errors("f", "f", [boston, ("toloc", "dallas")], [boston, denver]) == (1, 3)
    # a duplicated type, one deleted
    assert metrics.semantic_errors("f", "f", [boston], [boston, denver]) == (1, 3)
    # the same pair predicted twice but present once: one insertion (pairs are a multiset)
    assert metrics.semantic_errors("f", "f", [boston, boston], [boston]) == (1, 2)
    # a value under the wrong type: deletion + insertion
    assert metrics.semantic_errors("f", "f", [("fromloc", "boston")], [boston]) == (2, 2)
    # everything wrong: S (toloc), D (date), I (airline), intent
    assert metrics.semantic_errors("x", "y", [("toloc", "denver"), ("airline", "ua")],
                                   [boston, ("date", "monday")]) == (4, 3)


def test_semantic_errors_equal_the_minimum_edit_cost():
    rng = random.Random(1)
    for _ in range(400):
        pool = [(t, v) for t in "ab" for v in "xyz"]
        predicted = [rng.choice(pool) for _ in range(rng.randint(0, 4))]
        reference = [rng.choice(pool) for _ in range(rng.randint(0, 4))]
        errors, items = metrics.semantic_errors("i", "i", predicted, reference)
        assert errors == brute_force_slot_errors(predicted, reference), (predicted, reference)
        assert items == len(reference) + 1


def test_ser_is_a_corpus_ratio_not_a_mean_of_ratios():
    boston, denver = ("toloc", "boston"), ("toloc", "denver")
    # utterance 1: 1 error over 3 items; utterance 2: 1 error (intent) over 1 item
    ser = metrics.semantic_error_rate(["f", "a"], ["f", "b"], [[boston], []], [[boston, denver], []])
    assert ser == pytest.approx(100.0 * 2 / 4)
    assert ser != pytest.approx(100.0 * (1 / 3 + 1) / 2)
    assert metrics.semantic_error_rate([], [], [], []) == 0.0
    with pytest.raises(ValueError):
        metrics.semantic_error_rate(["f"], ["f", "g"], [[]], [[]])


def test_slot_values_join_span_words():
    tokens = "from new york to boston".split()
    tags = "O B-fromloc I-fromloc O B-toloc".split()
    assert metrics.slot_values(tokens, tags) == [("fromloc", "new york"), ("toloc", "boston")]
