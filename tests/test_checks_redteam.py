"""Red-team regressions for the step checks of eDP-SGD (a gradient the engine did not issue) and DPTrainer's
refusal to evaluate on the training rows. Each test failed on the code it was written against; tiny models and
datasets built in code."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from dptext.errors import UserError
from test_edp_redteam import engine_for


@pytest.mark.parametrize("write", ["in_place", "assigned"])
def test_a_foreign_gradient_written_through_grad_data_is_refused(write):
    """.grad.data shares .grad's memory but not its version counter: other examples' gradient added (or assigned)
    through it between a unit's chunks joined the unit's clip unseen, 4C where 2C is accounted."""
    model, _, engine = engine_for(noise_multiplier=0.0)
    x = torch.randn(6, 4)
    engine.accumulate(model(x[:2]).pow(2).sum(1))  # the unit's first chunk
    foreign = torch.autograd.grad(model(x[2:]).pow(2).sum(), model.weight)[0]  # other examples
    if write == "in_place":
        model.weight.grad.data.add_(foreign)
    else:
        model.weight.grad.data = model.weight.grad + foreign
    with pytest.raises(UserError, match="not issued by the engine"):
        engine.close_unit()
    assert engine.clipped_grads() == {}


# --------------------------------------------------------------------------- DPTrainer: evaluation on training rows

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from dptext.integrations import DPTrainer, PrivacyArguments  # noqa: E402
from dptext.integrations.trainer_checks import refuse_evaluation_on_training_data, row_digests  # noqa: E402
from test_hf_trainer import C, causal_model, collate, dataset, training_args  # noqa: E402


def long_rows(seed: int, count: int = 6) -> list[dict]:
    """Rows as a numpy-formatted datasets.Dataset gives them: one prompt template, padded to a fixed length."""
    generator = np.random.default_rng(seed)
    return [{"input_ids": np.concatenate([[1, 2, 3], generator.integers(3, 200, 2000), [0, 0, 0]]), "label": 0}
            for _ in range(count)]



def test_long_numpy_rows_of_another_set_are_not_taken_for_training_rows():
    """numpy's repr abbreviates an array of over 1000 values to its first and last three ('[1, 2, 3, ..., 0, 0,
    0]'), so every padded row with the same template digested alike: a held-out set was refused as a copy."""
    train = long_rows(0)
    refuse_evaluation_on_training_data(long_rows(1), train, row_digests(train))


def test_a_copy_of_list_rows_given_as_numpy_arrays_is_refused():
    """The same rows with numpy arrays (a datasets.Dataset in numpy format) where training had lists digested
    apart, so the copy was evaluated."""
    train = [{key: value.tolist() if isinstance(value, np.ndarray) else value for key, value in row.items()}
             for row in long_rows(0)]
    with pytest.raises(UserError, match="a copy of its rows"):
        refuse_evaluation_on_training_data(long_rows(0), train, row_digests(train))


class SizedStream(torch.utils.data.IterableDataset):
    """A held-out stream that knows its length (for progress bars) but cannot be indexed."""

    def __iter__(self):
        yield from dataset(seed=1)

    def __len__(self):
        return len(dataset(seed=1))


def test_a_sized_iterable_eval_set_is_not_a_crash():
    """row i of a torch IterableDataset with __len__ was read by indexing: NotImplementedError from evaluate."""
    train = dataset()
    refuse_evaluation_on_training_data(SizedStream(), train, row_digests(train))


def trainer_with(tmp_path, eval_dataset=None) -> DPTrainer:
    return DPTrainer(model=causal_model(), args=training_args(tmp_path), train_dataset=dataset(),
                     eval_dataset=eval_dataset, data_collator=collate,
                     privacy=PrivacyArguments(max_grad_norm=C, expected_batch_size=8, noise_multiplier=1.0))


def test_evaluate_given_the_name_of_a_copy_is_refused(tmp_path):
    """Trainer.evaluate('name') evaluates eval_dataset['name']; DPTrainer checked the string itself (its
    characters as rows), so a copy of the training rows among the eval datasets was evaluated by name."""
    copied = [dict(row) for row in dataset()]
    trainer = trainer_with(tmp_path, {"held_out": dataset(seed=1), "copy": copied})
    with pytest.raises(UserError, match="a copy of its rows"):
        trainer.evaluate("copy")
    assert "held_out_loss" in trainer.evaluate("held_out", metric_key_prefix="held_out")


def test_a_copy_differing_only_in_a_column_the_model_never_sees_is_refused(tmp_path):
    """Rows were digested whole: a copy whose 'id' column was renumbered (the Trainer drops it before the model,
    remove_unused_columns) was told apart and evaluated. Rows are compared by the columns the model is fed."""
    trainer = trainer_with(tmp_path)
    with pytest.raises(UserError, match="a copy of its rows"):
        trainer.evaluate([{**row, "id": row["id"] + 1000} for row in dataset()])


def test_a_torch_formatted_datasets_dataset_is_digested_as_fast_as_a_plain_one():
    """row_digests read a datasets.Dataset one row at a time, ~15x slower in torch format (each row converted to
    tensors, then back to lists): minutes for a training set of a few hundred thousand rows at the first evaluate.
    Both formats are read in batches as plain Python now, and digest alike."""
    datasets = pytest.importorskip("datasets")
    plain = datasets.Dataset.from_dict({"input_ids": [[i % 97] * 64 for i in range(3000)], "label": [0] * 3000})
    formatted = plain.with_format("torch")
    start = time.perf_counter()
    expected = row_digests(plain)
    middle = time.perf_counter()
    assert row_digests(formatted) == expected
    assert time.perf_counter() - middle < 4 * (middle - start) + 0.5
