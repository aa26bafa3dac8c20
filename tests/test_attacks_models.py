"""The attack classifiers and scores: logistic regression against scikit-learn, LiRA against its formula,
the member / non-member split against its specification."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from dptext.attacks import attack_models
from dptext.data import audit_split
from dptext.errors import UserError


def test_logistic_regression_matches_sklearn():
    linear_model = pytest.importorskip("sklearn.linear_model")
    rng = np.random.default_rng(0)
    features = rng.normal(size=(600, 5)) * [1, 3, 0.1, 10, 1] + [0, 5, 0, -2, 1]
    labels = (features @ [1, -0.3, 4, 0.05, 0] + rng.normal(size=600) > 0).astype(float)
    ours = attack_models.LogisticRegression(l2=0.5).fit(features, labels)
    standardised = (features - features.mean(0)) / features.std(0)
    reference = linear_model.LogisticRegression(C=1 / 0.5, tol=1e-10, max_iter=10000).fit(standardised, labels)
    np.testing.assert_allclose(ours.weights[1:], reference.coef_[0], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(ours.decision_function(features), reference.decision_function(standardised),
                               rtol=1e-4, atol=1e-5)


def test_shadow_attack_learns_the_direction_from_shadows():
    rng = np.random.default_rng(1)
    shadow_in, shadow_out = rng.normal(1, 1, (300, 3)), rng.normal(0, 1, (300, 3))
    target_in, target_out = rng.normal(1, 1, (200, 3)), rng.normal(0, 1, (200, 3))
    scores = attack_models.shadow_attack(np.r_[shadow_in, shadow_out], np.r_[np.ones(300), np.zeros(300)],
                                         np.r_[target_in, target_out])
    assert scores[:200].mean() > scores[200:].mean() + 1


def test_lira_offline_is_a_z_score_against_the_out_gaussian():
    rng = np.random.default_rng(2)
    references = rng.normal(size=(3, 50)) + np.arange(50)
    target = np.arange(50) + 2.0
    z = attack_models.lira_offline(target, references)
    mean = references.mean(0)
    global_std = np.sqrt(np.mean([np.var(references[:, i], ddof=1) for i in range(50)]))
    np.testing.assert_allclose(z, (target - mean) / global_std)
    many = rng.normal(size=(20, 50))
    np.testing.assert_allclose(attack_models.lira_offline(target, many),
                               (target - many.mean(0)) / many.std(0, ddof=1))
    assert np.all(attack_models.loss_attack([1.0, 2.0]) == [-1.0, -2.0])


def recipe(**audit):
    values = dict(holdout_fraction=0.0, holdout_examples=None, public_examples=0, seed=0, train_indices=[],
                  canaries=0, canary_repetitions=[1, 10], canary_prefix="p", canary_words=2, canary_vocabulary=10,
                  canary_unit="example", one_run_canaries=0)
    return SimpleNamespace(audit=SimpleNamespace(**{**values, **audit}),
                           task=SimpleNamespace(type="table_to_text", control_codes=[]))


def test_split_partitions_the_training_split_and_is_seeded():
    train = [{"mr": f"m{i}", "ref": f"r{i}"} for i in range(100)]
    split = audit_split.split_for_audit(recipe(holdout_fraction=0.2, public_examples=30, canaries=1), train)
    sets = [{i for i, _ in part} for part in (split.members, split.nonmembers, split.public)]
    assert [len(s) for s in sets] == [50, 20, 30]
    assert set.union(*sets) == set(range(100)) and sum(map(len, sets)) == 100
    assert all(train[i] is record for i, record in split.members)
    records = split.training_records("table_to_text", [])
    assert len(records) == 50 + 1 + 10 and records[:50] == [r for _, r in split.members]
    assert records[-1] == {"mr": "p", "ref": split.canaries["canaries"][1]["secret"]}
    again = audit_split.split_for_audit(recipe(holdout_fraction=0.2, public_examples=30, canaries=1), train)
    assert again.nonmembers == split.nonmembers
    other = audit_split.split_for_audit(recipe(holdout_fraction=0.2, public_examples=30, seed=1), train)
    assert other.nonmembers != split.nonmembers
    exact = audit_split.split_for_audit(recipe(holdout_fraction=0.2, holdout_examples=7), train)
    assert len(exact.nonmembers) == 7
    chosen = audit_split.split_for_audit(recipe(train_indices=[3, 1, 4]), train)
    assert [i for i, _ in chosen.members] == [1, 3, 4] and not chosen.nonmembers


@pytest.mark.parametrize("audit", [dict(holdout_fraction=0.2, public_examples=30, canaries=1),
                                   dict(holdout_examples=7, canaries=3, canary_repetitions=[2, 5]),
                                   dict(train_indices=[3, 1, 4, 4]), dict(holdout_fraction=0.25),
                                   dict(holdout_examples=7, canaries=3, one_run_canaries=20)])
def test_trained_size_counts_what_the_split_trains_on(audit):
    train = [{"mr": f"m{i}", "ref": f"r{i}"} for i in range(100)]
    spec = recipe(**audit)
    records = audit_split.split_for_audit(spec, train).training_records("table_to_text", [])
    assert audit_split.trained_size(spec.audit, len(train)) == len(records)


def test_one_run_canaries_are_distinct_from_the_exposure_canaries_and_trained_once_if_included():
    spec = recipe(canaries=5, canary_repetitions=[1, 2], one_run_canaries=30)
    split = audit_split.split_for_audit(spec, [{"mr": f"m{i}", "ref": f"r{i}"} for i in range(20)])
    one_run = split.one_run["canaries"]
    secrets = [c["secret"] for c in one_run]
    assert len(set(secrets)) == 30 and not set(secrets) & {c["secret"] for c in split.canaries["canaries"]}
    refs = [r["ref"] for r in split.training_records("table_to_text", [])]
    assert all(refs.count(c["secret"]) == int(c["included"]) for c in one_run)
    assert 0 < sum(c["included"] for c in one_run) < 30


def test_split_refuses_impossible_requests():
    train = [{"mr": "m", "ref": "r"}] * 10
    with pytest.raises(UserError, match="leave some to train on"):
        audit_split.split_for_audit(recipe(holdout_examples=5, public_examples=5), train)
    with pytest.raises(UserError, match="outside the training split"):
        audit_split.split_for_audit(recipe(train_indices=[10]), train)
    classification = recipe(canaries=1)
    classification.task.type = "classification"
    with pytest.raises(UserError, match="language-model task"):
        audit_split.split_for_audit(classification, train)
    assert not audit_split.audit_requested(recipe().audit)
