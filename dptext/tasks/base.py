"""What every training objective provides to the fine-tuning loop.

A task turns records into tokenised ``Example``s, pads them into batches, computes one loss
per example (never a batch average: DP clips each example, SPEC §1) and evaluates a model on
held-out records. The loop knows nothing else about the task.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence

from dptext.errors import UserError
from dptext.models import load_model
from dptext.tasks.encoding import Example, pad_batch


class Task(ABC):
    """Base class: subclasses set ``head`` and ``primary_metric`` and implement the abstract hooks."""

    head = "causal_lm"  # the model head dptext.models.load_model must build
    primary_metric = "perplexity"
    higher_is_better = False
    # evaluate() keeps its finished batches in a journal (dptext.tasks.eval_journal) when the run passes one: worth
    # it where evaluation is long (generation, perplexity over many references), not for a classifier's pass
    journals_evaluation = False

    def __init__(self, recipe: Any, tokenizer: Any):
        self.recipe = recipe
        self.tokenizer = tokenizer
        self.max_length = recipe.data.max_length
        self.reduction = recipe.task.loss_reduction

    @property
    def num_labels(self) -> int | None:
        """Output classes for classification heads; None for language-model heads."""
        return None

    def load_model(self):
        """The model this task trains, as ``recipe.model`` describes it."""
        recipe = self.recipe
        model, _ = load_model(recipe.model.name, head=self.head, num_labels=self.num_labels,
                              random_init=recipe.model.adaptation == "retrain", seed=recipe.train.seed)
        return model

    @abstractmethod
    def encode(self, records: Sequence[dict[str, Any]]) -> list[Example]:
        """Tokenised training examples, loss masks included."""

    def collate(self, examples: Sequence[Example]) -> dict[str, Any]:
        return pad_batch(examples, self.tokenizer.pad_token_id)

    @abstractmethod
    def per_example_loss(self, model: Any, batch: dict[str, Any]):
        """A (B,) tensor: each example's loss over its own tokens only."""

    def probe_batch(self, model: Any, generator: Any, batch_size: int, seq_len: int) -> dict[str, Any]:
        """SYNTHETIC inputs in this task's batch format (random ids and labels, never a record; see
        ``dptext.tasks.probe_batches``), on which the privacy engine's start-up probe checks the engine against
        brute-force autograd with ``per_example_loss``. Every task the recipes can name overrides it."""
        raise UserError(f"{type(self).__name__} gives the privacy engine's start-up probe no synthetic batch, so "
                        "its loss cannot be verified; add probe_batch to the task (or set privacy.verify=false "
                        "at your own risk).")

    @abstractmethod
    def evaluate(self, model: Any, records: Sequence[dict[str, Any]], *, batch_size: int,
                 on_progress: Callable[[int], None] | None = None, journal: Any = None) -> dict[str, float]:
        """The task's metrics on ``records`` (a held-out split). ``journal`` (``dptext.tasks.eval_journal``): where
        a long evaluation keeps its finished batches so an interrupted one resumes; a short one may ignore it."""

    def evaluation_size(self, records: Sequence[dict[str, Any]]) -> int:
        """Units of work ``evaluate`` reports through ``on_progress`` (for a progress bar)."""
        return len(records)


def batches(items: Sequence[Any], size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]
