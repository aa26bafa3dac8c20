"""Micro-batches are cut from the sampled rows ordered by length (user-level: users by their longest row), and the
order changes the cost, not the result."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from dptext import config
from dptext.finetune import run_finetune
from dptext.finetune.loop import chunks_of, shortest_first
from dptext.finetune.user_level import shortest_users_first
from dptext.tasks.encoding import Example


def _examples(lengths):
    return [Example(input_ids=[1] * n, labels=[]) for n in lengths]


def _final_weights(recipe, run):
    """Train ``recipe`` into ``run`` and return the weights of its last checkpoint."""
    run_finetune(recipe, out=run)
    latest = (run / "checkpoints" / "LATEST").read_text().strip()
    return torch.load(run / "checkpoints" / latest, weights_only=False)["model"]


def test_shortest_first_is_a_stable_sort_by_length():
    examples = _examples([5, 2, 9, 2, 7, 5])
    assert shortest_first(examples, [0, 1, 2, 3, 4, 5]) == [1, 3, 0, 5, 4, 2]
    assert shortest_first(examples, [5, 3, 0, 1]) == [3, 1, 5, 0]  # ties keep the sampled order


def test_example_level_micro_batches_group_rows_of_similar_length():
    training = SimpleNamespace(examples=_examples([30, 3, 28, 4, 29, 2]), physical_batch_size=2, dist=None)
    chunks = [chunk for chunk, owners in chunks_of(training, [0, 1, 2, 3, 4, 5], None)]
    assert chunks == [[5, 1], [3, 2], [4, 0]]


@pytest.mark.integration
def test_a_private_run_ends_at_the_same_weights_whatever_the_micro_batch_size(shared_data, tmp_path):
    """Sorted micro-batches of 3 and one micro-batch of the whole logical batch give the same clipped sums, so with
    the same (reproducible) noise the weights agree to float rounding."""
    weights = []
    for physical in (3, 64):
        recipe = config.load_recipe(None, [
            "name=order", "model.name=tiny-llama", "data.dataset=amazon",  # Llama: no dropout to differ by row
            f"data.path={shared_data / 'amazon_multidomain_sentiment'}", "task.control_codes=[category, rating]",
            "data.max_train_examples=48", "data.max_eval_examples=8", "data.max_length=64",
            "task.type=language_modeling", "train.batch_size=12", "train.max_steps=3",
            f"train.physical_batch_size={physical}", "privacy.target_epsilon=8", "privacy.reproducible_noise=true",
            "train.seed=5", "train.learning_rate=1e-3"])
        weights.append(_final_weights(recipe, tmp_path / f"physical-{physical}"))
    assert weights[0].keys() == weights[1].keys()
    for name, tensor in weights[0].items():
        torch.testing.assert_close(tensor, weights[1][name], rtol=1e-4, atol=1e-5, msg=name)


def test_users_are_ordered_by_their_longest_row_and_stay_together():
    indices, users = [10, 11, 12, 13, 14, 15], [7, 3, 7, 9, 3, 1]
    lengths = [40, 5, 8, 20, 6, 30]
    rows, owners = shortest_users_first(lengths, indices, users)
    assert owners == [3, 3, 9, 1, 7, 7]  # longest rows: user 3 → 6, user 9 → 20, user 1 → 30, user 7 → 40
    assert rows == [11, 14, 13, 15, 12, 10]  # within user 7, its 8-token row before its 40-token row
    assert sorted(zip(rows, owners)) == sorted(zip(indices, users))  # a reordering: no row lost, none re-owned


def test_user_level_micro_batches_group_users_of_similar_length():
    training = SimpleNamespace(examples=_examples([30, 3, 28, 4, 2, 29]), physical_batch_size=2, dist=None)
    chunks = list(chunks_of(training, [0, 1, 2, 3, 4, 5], [0, 1, 0, 2, 1, 3]))
    assert chunks == [([4, 1], [1, 1]), ([3, 5], [2, 3]), ([2, 0], [0, 0])]  # users 2 and 3 share one


@pytest.mark.integration
def test_a_user_level_run_ends_at_the_same_weights_whatever_the_micro_batch_size(tmp_path):
    """User-level micro-batches (sorted by each user's longest row) of 3 rows and of the whole batch give the same
    per-user clipped sums, so with the same (reproducible) noise the weights agree to float rounding."""
    folder = tmp_path / "data"
    folder.mkdir()
    words = ["good", "bad", "fine", "great", "awful", "dull", "bright", "slow"]
    rows = [{"text": " ".join(words[(u * 3 + i + j) % 8] for j in range(1 + (u * 5 + i) % 9)), "label": (u + i) % 2,
             "user": f"u{u}"} for u in range(16) for i in range(1 + u % 3)]
    for split, part in (("train", rows), ("validation", rows[:6])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    weights = []
    for physical in (3, 64):
        recipe = config.load_recipe(None, [
            "name=users", "model.name=tiny-llama", "task.type=classification", "data.dataset=jsonl",  # no dropout
            f"data.path={folder}", "data.max_length=16", "eval.split=validation", "task.labels=[0, 1]",
            "train.batch_size=8", "train.max_steps=3", "train.learning_rate=1e-3", "privacy.target_epsilon=8",
            "privacy.unit=user", "data.user_column=user", "privacy.max_examples_per_user=3",
            f"train.physical_batch_size={physical}", "privacy.reproducible_noise=true", "train.seed=5"])
        weights.append(_final_weights(recipe, tmp_path / f"physical-{physical}"))
    for name, tensor in weights[0].items():
        torch.testing.assert_close(tensor, weights[1][name], rtol=1e-4, atol=1e-5, msg=name)
