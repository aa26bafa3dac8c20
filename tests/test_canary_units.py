"""Canaries per user (issue 24): audit.canary_unit=user makes a canary's copies one synthetic user, the audit files
never hold a user id, and `dptext mia canary --compare-units` trains example- and user-level runs and reports both."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from dptext.attacks.canary_units import check_comparable, train_or_reuse, unit_overrides
from dptext.config import AuditConfig, PrivacyConfig
from dptext.data.audit_split import AUDIT_DIR, AuditSplit, write_audit
from dptext.data.canaries import make_canaries
from dptext.errors import UserError

from canary_cases import TINY, cli, write_recipe

SECRET_USER = "zqsecretuserzq"


def _split(unit: str, users: bool) -> AuditSplit:
    audit = AuditConfig(canaries=2, canary_repetitions=[3], canary_words=2, canary_vocabulary=10, seed=5,
                        canary_unit=unit)
    members = [(i, {"text": f"line {i}", **({"user": SECRET_USER} if users else {})}) for i in range(4)]
    return AuditSplit(members=members, canaries=make_canaries(audit), seed=5)


def test_a_canary_is_one_synthetic_user_or_one_user_per_copy():
    records = _split("user", users=True).training_records("language_modeling", [])
    planted = records[4:]
    assert len(planted) == 6 and [r["text"] for r in planted[:3]] == [planted[0]["text"]] * 3
    assert [r["user"] for r in planted] == ["canary-5-0"] * 3 + ["canary-5-1"] * 3
    each = [r["user"] for r in _split("example", users=True).training_records("language_modeling", [])[4:]]
    assert len(set(each)) == 6 and SECRET_USER not in each
    assert all("user" not in r for r in _split("user", users=False).training_records("language_modeling", []))


def test_a_real_user_named_like_a_canary_is_refused():
    split = _split("user", users=True)
    split.members[0][1]["user"] = "canary-5-1"
    with pytest.raises(UserError, match="change audit.seed"):
        split.training_records("language_modeling", [])


def test_audit_files_hold_no_user_id(tmp_path):
    split = _split("user", users=True)
    split.nonmembers = [(9, {"text": "held out", "user": SECRET_USER})]
    folder = write_audit(tmp_path, split, trained_on=10)
    written = "".join(path.read_text() for path in folder.iterdir())
    assert "line 0" in written and "held out" in written and SECRET_USER not in written
    assert json.loads((folder / "canaries.json").read_text())["unit"] == "user"


def _recipe(**changes) -> SimpleNamespace:
    base = {"canaries": 1, "user_column": "author", "enabled": True}
    base.update(changes)
    return SimpleNamespace(audit=SimpleNamespace(canaries=base["canaries"]),
                           data=SimpleNamespace(user_column=base["user_column"]),
                           privacy=SimpleNamespace(enabled=base["enabled"]))


@pytest.mark.parametrize("changes, fragment", [({"canaries": 0}, "audit.canaries"),
                                               ({"user_column": None}, "data.user_column"),
                                               ({"enabled": False}, "privacy.enabled")])
def test_a_comparison_that_cannot_show_the_difference_is_refused_before_training(changes, fragment):
    with pytest.raises(UserError, match=fragment):
        check_comparable({"example": _recipe(**changes), "user": _recipe(**changes)})
    check_comparable({"example": _recipe(), "user": _recipe()})
    assert unit_overrides("user") == ["privacy.unit=user", "audit.canary_unit=user"]
    assert unit_overrides("example") == ["privacy.unit=example", "privacy.max_examples_per_user=",
                                         "audit.canary_unit=user"]


def test_finished_runs_are_reused_and_new_ones_trained(tmp_path):
    calls = []

    def train(recipe=None, out=None, resume=None, output=None):
        calls.append((recipe, out, resume))

    output = SimpleNamespace(info=lambda message: None)
    train_or_reuse("recipe", tmp_path / "fresh", train, output)
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "result.json").write_text("{}")
    train_or_reuse("recipe", tmp_path / "done", train, output)
    assert calls == [("recipe", tmp_path / "fresh", None)]


def _user_data(root: Path) -> Path:
    """Language-model lines by 12 authors (2 training lines each: more users than a batch); the other splits alike."""
    root.mkdir()
    for split, size in (("train", 24), ("validation", 6), ("test", 6)):
        rows = [{"text": f"the weather today is {'sunny' if i % 2 else 'grey'} number {i}", "author": f"a{i % 12}"}
                for i in range(size)]
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


CANARY_RUN = ["model.name=tiny-llama", "task.type=language_modeling", "data.dataset=jsonl", "data.user_column=author",
              "audit.canaries=1", "audit.canary_repetitions=[4]", "audit.canary_words=2",
              "audit.canary_vocabulary=10"]


def test_example_level_run_reports_its_unit_and_user_canaries(tmp_path, capsys):
    data = _user_data(tmp_path / "data")
    run = tmp_path / "run"
    cli(capsys, "finetune", str(write_recipe(tmp_path / "lm.yaml")), *TINY, *CANARY_RUN, f"data.path={data}",
        "audit.canary_unit=user", "--out", str(run))
    report = cli(capsys, "mia", "canary", str(run), "--candidates", "20")["runs"][0]
    assert report["canary_unit"] == "user" and report["privacy"]["unit"] == "example"
    assert report["by_repetitions"][0]["repetitions"] == 4 and report["candidates"] == 20


@pytest.mark.slow  # two tiny trainings and their scoring: about a minute on this project's loaded 2-core machine
@pytest.mark.skipif("unit" not in {f.name for f in dataclasses.fields(PrivacyConfig)},
                    reason="privacy.unit arrives with the user-level training loop (issue 24, branch user)")
def test_compare_units_trains_both_units_and_reports_them(tmp_path, capsys):
    data = _user_data(tmp_path / "data")
    out = tmp_path / "units"
    reports = cli(capsys, "mia", "canary", *TINY, *CANARY_RUN, f"data.path={data}",
                  "privacy.max_examples_per_user=4", "--compare-units", str(write_recipe(tmp_path / "lm.yaml")),
                  "--out", str(out), "--candidates", "20")["runs"]
    assert [r["privacy"]["unit"] for r in reports] == ["example", "user"]
    assert all(r["canary_unit"] == "user" for r in reports)
    assert (out / "user" / "result.json").is_file() and (out / "example" / AUDIT_DIR).is_dir()
