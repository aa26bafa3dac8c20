"""Users in the data layer (issue 24): data.user_column fills record["user"], data.missing_user refuses or drops
training records without one, `dptext data` shows examples per user as counts only, and no user id is ever printed
or put in an error message."""

from __future__ import annotations

import json
import statistics

import pytest

from dptext.cli.app import main
from dptext.config import DataConfig
from dptext.data import load_records, load_split
from dptext.data.users import user_groups, user_statistics
from dptext.errors import UserError

# user ids no output may contain: the canary of this file
SECRET_USERS = ["zqalicezq", "zqbobzq", "zqcarolzq"]


def _rows() -> list[dict]:
    """Alice 4 examples, Bob 2, Carol 1, two without a user (missing key's value None, blank)."""
    owners = [0, 0, 1, 0, 2, 1, 0]
    rows = [{"text": f"example {i}", "label": i % 2, "author": SECRET_USERS[u]} for i, u in enumerate(owners)]
    rows += [{"text": "no author", "label": 0, "author": None}, {"text": "blank author", "label": 1, "author": "  "}]
    return rows


@pytest.fixture
def folder(tmp_path):
    rows = _rows()
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "test.jsonl").write_text(json.dumps(rows[-1]) + "\n")
    header = "text,label,author\n" + "".join(f"{r['text']},{r['label']},{r['author'] or ''}\n" for r in rows)
    (tmp_path / "all.csv").write_text(header)
    return tmp_path


def test_generic_reader_puts_the_user_column_in_record_user(folder):
    records = load_split("jsonl", "train", folder, user_column="author", missing_user="keep")
    assert [r["user"] for r in records] == [SECRET_USERS[u] for u in (0, 0, 1, 0, 2, 1, 0)] + [None, None]
    assert "user" not in load_split("jsonl", "train", folder)[0]  # no user column: records as before
    numbered = load_split("jsonl", "train", folder, user_column="label", missing_user="keep")
    assert {r["user"] for r in numbered} == {"0", "1"}  # ids are text, also when the column holds numbers


def test_missing_users_refused_with_the_count_or_dropped_in_training_only(folder):
    with pytest.raises(UserError) as refused:
        load_split("jsonl", "train", folder, user_column="author")
    message = str(refused.value)
    assert "2 of 9 training records" in message and "data.missing_user=drop" in message
    assert not any(user in message for user in SECRET_USERS)
    kept = load_split("jsonl", "train", folder, user_column="author", missing_user="drop")
    assert len(kept) == 7 and all(r["user"] in SECRET_USERS for r in kept)
    test = load_split("jsonl", "test", folder, user_column="author")  # evaluation is never refused for users
    assert [r["user"] for r in test] == [None]
    config = DataConfig(dataset="csv", path=str(folder / "all.csv"), user_column="author", missing_user="drop",
                        validation_fraction=0.0)
    assert sorted(r["user"] for r in load_records(config, "train")) == sorted(r["user"] for r in kept)


def test_unknown_user_column_and_readers_without_users_are_refused(folder, shared_data):
    with pytest.raises(UserError, match="has no column 'writer'.*data.user_column"):
        load_split("jsonl", "train", folder, user_column="writer")
    with pytest.raises(UserError, match="sst2 reader has no user column"):
        load_split("sst2", "train", shared_data / "sst2", user_column="author")
    with pytest.raises(UserError, match="only user column is 'reviewer'"):
        load_split("amazon", "train", shared_data / "amazon_multidomain_sentiment", user_column="author")


def test_user_groups_and_statistics_against_a_direct_count(folder):
    records = load_split("jsonl", "train", folder, user_column="author", missing_user="drop")
    groups = user_groups(records)
    assert groups == [[0, 1, 3, 6], [2, 5], [4]]
    stats = user_statistics(load_split("jsonl", "train", folder, user_column="author", missing_user="keep"))
    assert (stats["users"], stats["examples"], stats["missing_user"]) == (3, 7, 2)
    assert stats["per_user"] == {"min": 1, "median": 2, "mean": 7 / 3, "max": 4}
    assert stats["bounds"] == [{"k": 1, "users_over_k": 2, "examples_kept": 3},
                               {"k": 2, "users_over_k": 1, "examples_kept": 5},
                               {"k": 3, "users_over_k": 1, "examples_kept": 6},
                               {"k": 4, "users_over_k": 0, "examples_kept": 7}]
    with pytest.raises(UserError, match="Training record 8 has no user"):
        user_groups(load_split("jsonl", "train", folder, user_column="author", missing_user="keep"))


def test_amazon_reviewers_counted_exactly(shared_data):
    """The counts docs/privacy_engine.md states: 8,000 reviews, 167 without a name, 7,170 reviewers (names with
    whitespace collapsed and case folded), 450 of them with more than one review, at most 11."""
    path = shared_data / "amazon_multidomain_sentiment"
    records = [r for split in ("train", "validation", "test")
               for r in load_split("amazon", split, path, user_column="reviewer", missing_user="keep")]
    stats = user_statistics(records)
    assert len(records) == 8_000 and stats["missing_user"] == 167
    assert (stats["users"], stats["per_user"]["max"]) == (7_170, 11)
    assert stats["bounds"][0] == {"k": 1, "users_over_k": 450, "examples_kept": 7_170}
    assert stats["examples"] - (stats["users"] - 450) == 1_113  # the reviews of reviewers with more than one
    with pytest.raises(UserError, match="131 of 6,378 training records of amazon have no user"):
        load_split("amazon", "train", path, user_column="reviewer")  # split by reviewer: other counts than by review
    plain = load_split("amazon", "train", path)
    assert "user" not in plain[0] and len(plain) == 6_400  # without a user column the reviewer is never read
    named = {split: {r["user"] for r in load_split("amazon", split, path, user_column="reviewer", missing_user="keep")
                     if r["user"]} for split in ("train", "validation", "test")}
    assert len(named["train"]) == 5_698  # docs/privacy_engine.md; no reviewer is in two splits
    assert not named["train"] & named["validation"] and not named["train"] & named["test"]


def test_dptext_data_shows_counts_per_user_never_ids(folder, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["data", "jsonl", "--path", str(folder), "--split", "train", "--user-column", "author", "--json"])
    captured = capsys.readouterr()
    assert exited.value.code == 0
    result = json.loads(captured.out)
    users = result["users"]["train"]
    assert (users["users"], users["missing_user"], users["per_user"]["median"]) == (3, 2, statistics.median([4, 2, 1]))
    assert all("user" not in record for record in result["examples"])
    with pytest.raises(SystemExit):
        main(["data", "jsonl", "--path", str(folder), "--split", "train", "--user-column", "author", "--show", "0"])
    table = capsys.readouterr().out
    assert "Examples per user" in table and "users with more than k" in table
    assert not any(user in table for user in SECRET_USERS)
