"""The Trainer's training batches, drawn by the privacy engine's Poisson sampler (SPEC §1).

A Hugging Face ``Trainer`` normally shuffles its dataset into fixed-size batches; the accountant covers Poisson
sampling only, so ``DPTrainer`` replaces that dataloader with this one. Each item it yields is one *logical* batch
(the examples of one Poisson draw with rate q: its size varies and may be 0), already cut into *physical*
micro-batches of ``per_device_train_batch_size`` and collated by the Trainer's data collator. The Trainer takes one
item per optimizer step, so one item is exactly one noisy step of the engine.

The Trainer iterates its dataloader once per epoch; this loader hands out ``steps_per_epoch`` batches each time
from one sampler built for the whole run, so the batches the engine is accounted for are the batches it trains on.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterator

from torch import nn

from dptext.errors import UserError

LABEL_COLUMNS = ("label", "labels", "label_ids")


class LogicalBatch:
    """One Poisson batch: ``chunks``, the collated physical micro-batches, and ``size``, its example count.

    Not a dict on purpose: the Trainer's own per-batch helpers (token counting, loss scaling) look for keys and
    find none, so nothing of the Trainer treats a logical batch as one forward pass."""

    def __init__(self, chunks: list[dict[str, Any]], size: int):
        self.chunks = chunks
        self.size = size

    def __contains__(self, key: object) -> bool:
        return False


class PoissonBatches:
    """Yields ``LogicalBatch`` items: ``steps_per_epoch`` per ``iter()``, from ``make_sampler()`` built once.

    ``make_sampler`` is called on the first ``iter()`` (when the Trainer has made the engine), so building this
    loader touches no data and draws nothing."""

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], dict[str, Any]], physical_batch_size: int,
                 steps_per_epoch: int, make_sampler: Callable[[], Any]):
        self.dataset = dataset  # the Trainer reads len(loader.dataset) for its "Num examples" line
        self.collate = collate
        self.physical_batch_size = physical_batch_size
        self.steps_per_epoch = steps_per_epoch
        self.make_sampler = make_sampler
        self._batches: Iterator[list[int]] | None = None

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[LogicalBatch]:
        if self._batches is None:
            self._batches = iter(self.make_sampler())
        for _ in range(self.steps_per_epoch):
            indices = next(self._batches, None)
            if indices is None:  # the run's planned steps are all taken
                return
            yield self.logical_batch(indices)

    def logical_batch(self, indices: list[int]) -> LogicalBatch:
        size = self.physical_batch_size
        chunks = [self.collate([self.dataset[i] for i in indices[start:start + size]])
                  for start in range(0, len(indices), size)]
        return LogicalBatch(chunks, len(indices))


def model_columns(model: nn.Module, remove_unused_columns: bool) -> set[str] | None:
    """The columns the Trainer feeds ``model`` (those its forward accepts, and the labels); None: every column."""
    return set(inspect.signature(model.forward).parameters) | set(LABEL_COLUMNS) if remove_unused_columns else None


def model_input_collator(collate: Callable[[list[Any]], dict[str, Any]], model: nn.Module,
                         remove_unused_columns: bool) -> Callable[[list[Any]], dict[str, Any]]:
    """The Trainer's collator, fed only the columns the model's forward accepts (and the labels) when
    ``remove_unused_columns`` is set, as the Trainer does for its own batches."""
    accepted = model_columns(model, remove_unused_columns)
    if accepted is None:
        return collate

    def collate_model_inputs(features: list[Any]) -> dict[str, Any]:
        if features and not isinstance(features[0], dict):
            raise UserError("DPTrainer's training dataset must yield dicts of model inputs (e.g. a tokenized "
                            "datasets.Dataset); map your examples to dicts before training.")
        return collate([{k: v for k, v in feature.items() if k in accepted} for feature in features])

    return collate_model_inputs
