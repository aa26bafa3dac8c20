"""Canary exposure maths and canary generation (secret sharer, SPEC §7)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats

from dptext.attacks import exposure
from dptext.data import canaries
from dptext.errors import UserError


def audit_section(**overrides):
    values = dict(canaries=2, canary_repetitions=[1, 10], canary_prefix="the secret code is", canary_words=3,
                  canary_vocabulary=10, seed=0, canary_unit="example")
    return SimpleNamespace(**{**values, **overrides})


def test_top_ranked_canary_has_exposure_log2_of_the_space():
    space = 100 ** 4
    candidates = np.random.default_rng(0).normal(50, 5, 5000)
    assert exposure.sampled_exposure(candidates.min() - 1, candidates, space) == pytest.approx(math.log2(space))
    assert exposure.exposure_from_rank(1, space) == math.log2(space)
    assert exposure.exposure_from_rank(space, space) == 0.0


def test_sampled_rank_scales_the_sample_to_the_space():
    candidates = np.arange(1000, dtype=float)  # 750 candidates are more likely (lower log-perplexity)
    assert exposure.sampled_rank(749.5, candidates, 10 ** 6) == 1 + (10 ** 6 - 1) * 0.75
    # tie: half
    assert exposure.sampled_rank(10.0, candidates, 10 ** 6) == pytest.approx(1 + (10 ** 6 - 1) * 10.5 / 1000)
    # brute force: rank among the sample itself, exactly
    scores = np.random.default_rng(1).normal(size=200)
    canary = scores[17]
    others = np.delete(scores, 17)
    brute = 1 + sum(s < canary for s in others)
    assert exposure.sampled_rank(canary, others, len(others) + 1) == pytest.approx(brute)
    with pytest.raises(ValueError):
        exposure.exposure_from_rank(0, 10)


@pytest.mark.parametrize("z", [-1.0, -3.0, -6.0])
def test_fitted_exposure_reads_the_tail_of_the_fitted_distribution(z):
    rng = np.random.default_rng(2)
    candidates = rng.normal(40, 4, 20000)
    fit = exposure.fitted_exposure(40 + 4 * z, candidates)
    assert fit["exposure"] == pytest.approx(-stats.norm.logcdf(z) / math.log(2), rel=0.08)
    # extrapolates beyond what the sample can resolve (log2 20000 ≈ 14.3 bits) for z = −6 (≈ 30 bits)
    if z == -6.0:
        assert fit["exposure"] > math.log2(candidates.size)


def test_canaries_are_seeded_distinct_and_grouped_by_repetitions():
    audit = audit_section()
    first, again = canaries.make_canaries(audit), canaries.make_canaries(audit)
    assert first == again
    secrets = [c["secret"] for c in first["canaries"]]
    assert len(set(secrets)) == 4 and [c["repetitions"] for c in first["canaries"]] == [1, 1, 10, 10]
    assert all(len(s.split()) == 3 and set(s.split()) <= set(first["vocabulary"]) for s in secrets)
    assert first["space_size"] == 1000
    assert canaries.make_canaries(audit_section(seed=1))["canaries"] != first["canaries"]


def test_candidates_enumerate_small_spaces_and_sample_large_ones():
    made = canaries.make_canaries(audit_section())
    every, exhaustive = canaries.sample_candidates(made, 5000, seed=0)
    assert exhaustive and len(every) == 1000 - 4 and len(set(every)) == len(every)
    assert not set(every) & {c["secret"] for c in made["canaries"]}
    drawn, exhaustive = canaries.sample_candidates(made, 100, seed=0)
    assert not exhaustive and len(drawn) == 100 and drawn == canaries.sample_candidates(made, 100, seed=0)[0]


def test_canary_records_per_task_and_refusals():
    assert canaries.canary_record("table_to_text", "p", "a b") == {"mr": "p", "ref": "a b"}
    assert canaries.canary_record("language_modeling", "p", "a b") == {"text": "p a b"}
    assert canaries.canary_record("dialog", "p", "a b") == {"history": ["p"], "response": "a b"}
    with pytest.raises(UserError, match="language-model task"):
        canaries.canary_record("classification", "p", "a b")
    with pytest.raises(UserError):
        canaries.make_canaries(audit_section(canary_vocabulary=1))
    with pytest.raises(UserError):
        canaries.make_canaries(audit_section(canary_repetitions=[0]))
    with pytest.raises(UserError, match="half the secret space"):
        canaries.make_canaries(audit_section(canaries=300, canary_words=2))
