"""Micro-batches are cut from the sampled rows ordered by length, and the order changes the cost, not the result."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dptext import config
from dptext.finetune import run_finetune
from dptext.finetune.loop import chunks_of, shortest_first
from dptext.tasks.encoding import Example


def _examples(lengths):
    return [Example(input_ids=[1] * n, labels=[]) for n in lengths]


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
        run = tmp_path / f"physical-{physical}"
        run_finetune(recipe, out=run)
        latest = (run / "checkpoints" / "LATEST").read_text().strip()
        weights.append(torch.load(run / "checkpoints" / latest, weights_only=False)["model"])
    assert weights[0].keys() == weights[1].keys()
    for name, tensor in weights[0].items():
        torch.testing.assert_close(tensor, weights[1][name], rtol=1e-4, atol=1e-5, msg=name)
