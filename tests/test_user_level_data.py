"""User-level data handling through `dptext finetune` (issue 43): subsets cut whole users, validation and test hold
other users than training, and the counts that depend on users stay out of the covered files."""

from __future__ import annotations

import csv
import json
import math
import re

import pytest
import torch

from dptext import config
from dptext.data import load_records
from dptext.data.users import user_groups
from dptext.errors import UserError
from dptext.finetune import run_finetune
from dptext.finetune.setup import build_training
from dptext.privacy.sampling.user_sampler import UserBatch

from test_user_level_finetune import _clipped_sum as loop_clipped_sum

pytestmark = pytest.mark.integration

K = 4
C = 0.05
WORDS = ["good", "bad", "fine", "great", "awful", "dull", "bright", "slow"]


def write_csv(path, users: int = 30, skip: str | None = None):
    """One csv file (split by dptext's seeded partition) of ``users`` users owning 1 … 4 records each, their records
    interleaved as in real files; ``skip`` leaves one user out (the neighbouring data set)."""
    rows = [{"text": f"{WORDS[(u + i) % 8]} {WORDS[(3 * u + i) % 8]} item {i}", "label": (u + i) % 2,
             "author": f"a{u}"} for i in range(4) for u in range(users) if i <= u % 4 and f"a{u}" != skip]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["text", "label", "author"])
        writer.writeheader()
        writer.writerows(rows)
    return path


def recipe(data, *extra: str):
    return config.load_recipe(None, [
        "model.name=tiny-bert", "task.type=classification", "data.dataset=csv", f"data.path={data}",
        "data.max_length=16", "eval.split=validation", "task.labels=[0, 1]", "train.batch_size=4",
        "train.max_steps=2", "train.learning_rate=1e-3", "privacy.target_epsilon=8", "privacy.unit=user",
        "data.user_column=author", f"privacy.max_examples_per_user={K}", "train.physical_batch_size=8",
        f"privacy.max_grad_norm={C}", "name=user-data", *extra])


def trained_users(recipe) -> dict[str, list[str]]:
    """Each trained user's id → its records' texts: the training split `build_training` reads, grouped as it
    groups it (``user_groups``: the privacy units the sampler draws)."""
    records = load_records(recipe.data, "train")
    return {records[own[0]]["user"]: [records[i]["text"] for i in own] for own in user_groups(records)}


def test_a_record_cut_is_refused_before_any_data_is_read(tmp_path, monkeypatch):
    from dptext.finetune import setup

    data = write_csv(tmp_path / "d.csv")
    monkeypatch.setattr(setup, "load_splits", lambda recipe: pytest.fail("data was read before the refusal"))
    with pytest.raises(UserError) as refused:
        build_training(recipe(data, "data.max_train_examples=20"))
    message = str(refused.value)
    assert "data.max_train_users" in message and not re.search(r"[.;]\s+[A-Z]", message)


@pytest.mark.parametrize("seed", [None, 3])
def test_max_train_users_keeps_whole_users_and_one_user_lets_at_most_one_other_in(seed, tmp_path):
    extra = ["data.max_train_users=6"] + ([f"data.sample_seed={seed}"] if seed is not None else [])
    kept = trained_users(recipe(write_csv(tmp_path / "d.csv"), *extra))
    all_users = trained_users(recipe(write_csv(tmp_path / "all.csv")))
    assert len(kept) == 6 and all(kept[u] == all_users[u] for u in kept)  # whole users, never parts
    assert sum(len(r) for r in kept.values()) > 6  # (users with several records: a record cut would differ)
    for removed in sorted(kept)[:3]:
        without = trained_users(recipe(write_csv(tmp_path / f"{removed}.csv", skip=removed), *extra))
        assert removed not in without and set(kept) - {removed} <= set(without)
        assert len(set(without) - set(kept)) <= 1 and all(without[u] == all_users[u] for u in without)


def every_user_sum(training) -> dict[str, torch.Tensor]:
    """The loop's clipped sum of a step that samples every user (≤ k rows each)."""
    training.model.eval()
    indices = [i for own in training.users for i in own[:K]]
    owners = [u for u, own in enumerate(training.users) for _ in own[:K]]
    return loop_clipped_sum(training, UserBatch(indices, owners))


def test_removing_a_user_outside_the_cut_changes_nothing_and_one_inside_moves_by_at_most_two_c(tmp_path):
    """Through the real finetune path: with the users' cut, removing one user of the data moves the clipped sum by
    0 (not kept) or by at most 2C (it leaves, at most one whole user enters: the replacement a record suffers under
    max_train_examples); a cut by records would let parts of several users in."""
    extra = ("data.max_train_users=5", "privacy.verify=false",  # the probe is tested elsewhere; this is the data
             "privacy.delta=1e-5")  # (the default 1/(2n) = 0.1 at n = 5 users is refused)
    full = build_training(recipe(write_csv(tmp_path / "d.csv"), *extra))
    kept = trained_users(full.recipe)
    base = every_user_sum(full)
    outside = next(f"a{u}" for u in range(30) if f"a{u}" not in kept)
    inside = max(kept, key=lambda u: len(kept[u]))
    for removed, bound in ((outside, 0.0), (inside, 2 * C)):
        other = build_training(recipe(write_csv(tmp_path / f"{removed}.csv", skip=removed), *extra))
        moved = every_user_sum(other)
        distance = math.sqrt(sum(float((base[n] - moved[n]).double().pow(2).sum()) for n in base))
        assert distance <= bound * (1 + 1e-4) + 1e-9, (removed, distance)


def test_held_out_users_and_counts_only_in_not_covered_files(tmp_path):
    """One run on a single csv: validation and test hold other users than training (and result.json and
    release.json say so); the exact numbers of users and records are in the not-covered diagnostics only."""
    data = write_csv(tmp_path / "d.csv", users=40)
    run = tmp_path / "run"
    result = run_finetune(recipe(data, "data.validation_fraction=0.2", "train.max_steps=1"), out=run)
    cfg = recipe(data, "data.validation_fraction=0.2").data
    named = {split: {r["user"] for r in load_records(cfg, split)} for split in ("train", "validation", "test")}
    assert named["validation"] and named["test"]
    assert not named["train"] & named["validation"] and not named["train"] & named["test"]
    assert "other users" in result["privacy"]["evaluation_users"]
    assert "other users" in json.loads((run / "release.json").read_text())["privacy_unit"]["evaluation_users"]
    groups = user_groups(load_records(cfg, "train"))
    users, records = len(groups), sum(len(own) for own in groups)
    assert records != users
    saved = json.loads((run / "result.json").read_text())
    assert "dataset_size" not in saved and not {"users", "examples"} & set(saved["privacy"])
    assert saved["privacy"]["dataset_size"] == users  # n: treated as public, as at example level
    manifest = {f["path"]: f["status"] for f in json.loads((run / "release.json").read_text())["files"]}
    for name, status in manifest.items():
        if status == "covered" and name.endswith(".json"):
            assert f'"records": {records}' not in (run / name).read_text(), name
    diagnostics = [json.loads(line) for line in (run / "diagnostics_not_private.jsonl").read_text().splitlines()]
    assert {"event": "training_data", "users": users, "records": records} in diagnostics
    assert manifest["diagnostics_not_private.jsonl"] == "not_covered"


def test_split_files_are_labelled_as_not_held_out(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    for split in ("train", "validation", "test"):
        write_csv(folder / f"{split}.csv")
    result = run_finetune(recipe(folder, "train.max_steps=1"), out=tmp_path / "run")
    assert "may hold training users' records" in result["privacy"]["evaluation_users"]
    manifest = json.loads((tmp_path / "run" / "release.json").read_text())
    assert "selection on validation" in manifest["privacy_unit"]["evaluation_users"]
