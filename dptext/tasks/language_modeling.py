"""Causal-LM objectives: plain (optionally control-coded) text, table-to-text, dialog responses.

All three train on prompt → completion with loss on the completion tokens only, and report
the completion perplexity on held-out records. Table-to-text adds generation (beam search)
scored by BLEU and ROUGE-L against all references of an input (Li et al. §5); dialog adds
generation scored by unigram F1 against the reference response.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from dptext import metrics
from dptext.data import group_references
from dptext.models.modes import evaluating
from dptext.privacy.losses import per_example_loss
from dptext.tasks import text_format
from dptext.tasks.base import Task, batches
from dptext.tasks.encoding import Example, encode_prompt_completion
from dptext.tasks.eval_journal import EvaluationJournal, journaled_batches
from dptext.tasks.generation import generate_completions
from dptext.tasks.probe_batches import language_model_batch, vocab_size


class LanguageModelingTask(Task):
    """Text (``record["text"]``), preceded by its control code when the recipe names code fields."""

    head = "causal_lm"
    primary_metric = "perplexity"
    higher_is_better = False
    journals_evaluation = True

    def prompt_and_completion(self, record: dict[str, Any]) -> tuple[str, str]:
        fields = self.recipe.task.control_codes
        if fields:  # the code conditions the text but is not itself learnt (DistilDP, SPEC §6)
            return text_format.control_code(record, fields) + "\n", record["text"]
        return "", record["text"]

    def encode(self, records: Sequence[dict[str, Any]]) -> list[Example]:
        return [encode_prompt_completion(self.tokenizer, *self.prompt_and_completion(r), self.max_length)
                for r in records]

    def per_example_loss(self, model: Any, batch: dict[str, Any]):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return per_example_loss(logits, batch["labels"], batch["attention_mask"], shift=True,
                                reduction=self.reduction)

    def probe_batch(self, model: Any, generator: Any, batch_size: int, seq_len: int) -> dict[str, Any]:
        return language_model_batch(self.probe_vocab(model), generator, batch_size, seq_len)

    def probe_vocab(self, model: Any) -> int:
        return vocab_size(model)

    def evaluate(self, model: Any, records: Sequence[dict[str, Any]], *, batch_size: int,
                 on_progress: Callable[[int], None] | None = None,
                 journal: EvaluationJournal | None = None) -> dict[str, float]:
        return {"perplexity": self.perplexity(model, records, batch_size, on_progress, journal)}

    def generate(self, model: Any, prompts: list[str], batch_size: int,
                 on_progress: Callable[[int], None] | None = None,
                 journal: EvaluationJournal | None = None) -> list[str]:
        """Completions by beam search with the recipe's eval settings (evaluation, not DP decoding)."""
        return generate_completions(model, self.tokenizer, prompts, beam_size=self.recipe.eval.beam_size,
                                    max_new_tokens=self.recipe.eval.max_new_tokens, batch_size=batch_size,
                                    on_batch=on_progress, journal=journal)

    def perplexity(self, model: Any, records: Sequence[dict[str, Any]], batch_size: int,
                   on_progress: Callable[[int], None] | None = None,
                   journal: EvaluationJournal | None = None) -> float:
        """exp(total completion-token NLL / completion tokens) over ``records``."""
        device = next(model.parameters()).device

        def nll_and_tokens(chunk: list[Example]) -> list[float]:
            batch = {k: v.to(device) for k, v in self.collate(chunk).items()}
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            nll = per_example_loss(logits, batch["labels"], batch["attention_mask"], shift=True, reduction="sum")
            return [nll.sum().item(), int((batch["labels"][:, 1:] != -100).sum())]

        total_nll, total_tokens = 0.0, 0
        with evaluating(model), torch.no_grad():
            for chunk, (nll, tokens) in journaled_batches(self.encode(records), batch_size, nll_and_tokens,
                                                          journal, "perplexity"):
                total_nll += nll
                total_tokens += int(tokens)
                if on_progress:
                    on_progress(len(chunk))
        return metrics.perplexity(total_nll, total_tokens)


class TableToTextTask(LanguageModelingTask):
    """E2E / DART: linearised table → reference text; BLEU and ROUGE-L by beam search."""

    primary_metric = "bleu"
    higher_is_better = True

    def prompt_and_completion(self, record: dict[str, Any]) -> tuple[str, str]:
        return text_format.table_prompt(record), " " + record["ref"]

    def evaluation_size(self, records: Sequence[dict[str, Any]]) -> int:
        return len(records) + len(group_references(records))

    def evaluate(self, model: Any, records: Sequence[dict[str, Any]], *, batch_size: int,
                 on_progress: Callable[[int], None] | None = None,
                 journal: EvaluationJournal | None = None) -> dict[str, float]:
        groups = group_references(records)
        hypotheses = self.generate(model, [text_format.table_prompt(g) for g in groups], batch_size, on_progress,
                                   journal)
        references = [g["refs"] for g in groups]
        return {"bleu": metrics.corpus_bleu(hypotheses, references),
                "rouge_l": metrics.rouge_l(hypotheses, references),
                "perplexity": self.perplexity(model, records, batch_size, on_progress, journal)}


class DialogTask(LanguageModelingTask):
    """History → response (chitchat, Persona-Chat); unigram F1 of generated responses and perplexity."""

    primary_metric = "f1"
    higher_is_better = True

    def prompt_and_completion(self, record: dict[str, Any]) -> tuple[str, str]:
        return text_format.dialog_prompt(record), " " + record["response"]

    def evaluation_size(self, records: Sequence[dict[str, Any]]) -> int:
        return 2 * len(records)

    def evaluate(self, model: Any, records: Sequence[dict[str, Any]], *, batch_size: int,
                 on_progress: Callable[[int], None] | None = None,
                 journal: EvaluationJournal | None = None) -> dict[str, float]:
        hypotheses = self.generate(model, [text_format.dialog_prompt(r) for r in records], batch_size, on_progress,
                                   journal)
        # A reply ends at its first line break: the next line would be the other speaker.
        hypotheses = [h.split("\n", 1)[0] for h in hypotheses]
        return {"f1": metrics.mean_token_f1(hypotheses, [r["response"] for r in records]),
                "perplexity": self.perplexity(model, records, batch_size, on_progress, journal)}
