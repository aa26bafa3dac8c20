"""Joint intent classification and slot filling (IC-NER) on ATIS and SNIPS (Dupuy et al. §4).

Records: ``{"tokens": [...], "tags": [...BIO...], "intent": str}`` (``dptext.data.atis``). The model is an encoder
(any HF BERT-style model, e.g. the offline ``minilm-l6`` or the paper's 4-layer 312-hidden BERT from the hub) with
two new heads: the intent head on the pooled sentence (``task.pooling``: BERT's pooled [CLS], or the masked mean of
the token states) and a BIO slot head on every word-piece. A word's tag is predicted at its first word-piece; the
others carry -100. Loss per example = intent cross-entropy + slot loss, where the slot loss is the per-token
cross-entropy (reduced per ``task.loss_reduction``), or with ``task.crf: true`` the negative log-likelihood of a
linear-chain CRF over the words (divided by the word count when the reduction is "mean"), as in the paper.

The intents and slot types are declared in the recipe (``task.intents``, ``task.slot_types``: public, from the
dataset's documentation; see ``dptext.tasks.label_sets``), never read from the training records, so the saved
``intent_slot_labels.json`` and the heads' shapes hold only declared labels. A training record with an
undeclared intent or tag is refused before training (or, with ``task.other_label``, its intent becomes that
intent and its undeclared tags O); an undeclared label in evaluation can never be predicted and is scored as an
error. Words cut off by ``data.max_length`` are predicted ``O``. Metrics (``dptext.metrics``):
``intent_acc``, span-level ``slot_f1`` (conlleval), ``ser`` (semantic error rate, the primary metric, lower is
better) and ``sentence_acc`` (intent and every tag right), all in percent over the evaluated split.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from dptext import metrics
from dptext.errors import UserError
from dptext.models import load_model
from dptext.models.modes import evaluating
from dptext.privacy.losses import per_example_loss
from dptext.tasks.base import Task, batches
from dptext.tasks.clc import SIZES as CLC_SIZES, build_clc
from dptext.tasks.crf import CRF
from dptext.tasks.encoding import IGNORE_INDEX, Example
from dptext.tasks.label_sets import check_records, declared_intents_and_tags, other_index
from dptext.tasks.probe_batches import char_ids, random_labels, token_batch, vocab_size, word_tag_fields

HEADS_FILE = "intent_slot_heads.pt"
LABELS_FILE = "intent_slot_labels.json"


class JointIntentSlotModel(nn.Module):
    """``encoder`` → intent head on the pooled states, slot head on every position (+ optional CRF).

    ``forward`` returns ``(intent_logits (B, I), slot_logits (B, T, K))``. The heads live in one ModuleDict
    named ``classifier`` so that every adaptation method trains them, as it does a classification head."""

    def __init__(self, encoder: nn.Module, intents: Sequence[str], tags: Sequence[str], *, pooling: str = "mean",
                 crf: bool = False, dropout: float = 0.1):
        super().__init__()
        self.labels = {"intents": list(intents), "tags": list(tags)}
        num_intents, num_tags = len(intents), len(tags)
        self.encoder = encoder
        self.config = encoder.config
        self.pooling = pooling
        self.dropout = nn.Dropout(dropout)
        hidden = encoder.config.hidden_size
        heads = {"intent": nn.Linear(hidden, num_intents), "slot": nn.Linear(hidden, num_tags)}
        if crf:
            heads["crf"] = CRF(num_tags)
        self.classifier = nn.ModuleDict(heads)
        pooler = getattr(encoder, "pooler", None)
        if pooler is not None and pooling == "mean":  # unused: keep it out of training (and of DP noise)
            pooler.requires_grad_(False)

    @property
    def crf(self) -> CRF | None:
        return self.classifier["crf"] if "crf" in self.classifier else None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **inputs: Any):
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **inputs)
        states = out.last_hidden_state
        if self.pooling == "mean":
            mask = attention_mask.unsqueeze(-1).to(states.dtype)
            pooled = (states * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        else:
            pooled = out.pooler_output if getattr(out, "pooler_output", None) is not None else states[:, 0]
        return self.classifier["intent"](self.dropout(pooled)), self.classifier["slot"](self.dropout(states))

    def save_pretrained(self, path: str | Path) -> None:
        """The encoder as a HF folder, the heads' weights (``intent_slot_heads.pt``) and the label names."""
        self.encoder.save_pretrained(path)
        torch.save({"classifier": self.classifier.state_dict(), "pooling": self.pooling},
                   Path(path) / HEADS_FILE)
        (Path(path) / LABELS_FILE).write_text(json.dumps(self.labels, indent=1))


def word_emissions(slot_logits: torch.Tensor, word_index: torch.Tensor) -> torch.Tensor:
    """(B, W, K) slot scores of each word, read at its first word-piece."""
    return slot_logits.gather(1, word_index.unsqueeze(-1).expand(-1, -1, slot_logits.shape[-1]))


def check_record_fields(records: Sequence[dict[str, Any]]) -> None:
    for record in records:
        if not {"tokens", "tags", "intent"} <= set(record):
            raise UserError("intent_slot needs records with tokens, tags and intent (data.dataset=atis or snips); "
                            f"got a record with the fields {sorted(record)}.")


class IntentSlotTask(Task):
    head = "base"
    primary_metric = "ser"
    higher_is_better = False

    def __init__(self, recipe: Any, tokenizer: Any, train_records: Sequence[dict[str, Any]]):
        super().__init__(recipe, tokenizer)
        check_record_fields(train_records)
        self.intents, self.tags = declared_intents_and_tags(recipe)
        self.intent_ids = {name: i for i, name in enumerate(self.intents)}
        self.tag_ids = {name: i for i, name in enumerate(self.tags)}
        # training labels outside the declared sets: refused, or (task.other_label) the "other" intent and O
        self.other_intent = other_index(recipe, self.intents, "task.intents")
        mapped = self.other_intent is not None
        check_records(train_records, lambda r: r["intent"] in self.intent_ids, mapped, "intent", "task.intents")
        check_records(train_records, lambda r: all(t in self.tag_ids for t in r["tags"]), mapped, "slot tag",
                      "task.slot_types")
        self.unknown_intent = self.other_intent if mapped else IGNORE_INDEX
        self.unknown_tag = self.tag_ids["O"] if mapped else IGNORE_INDEX
        self.use_crf = recipe.task.crf
        self.clc = recipe.model.name in CLC_SIZES  # word-level bi-LSTM encoder: one position per word

    def load_model(self):
        recipe = self.recipe
        if self.clc:
            encoder = build_clc(recipe.model.name, self.tokenizer, recipe.train.seed)
        else:
            encoder, _ = load_model(recipe.model.name, head="base", seed=recipe.train.seed,
                                    random_init=recipe.model.adaptation == "retrain")
        with torch.random.fork_rng(devices=[]):  # new heads: seeded, whatever ran before
            torch.manual_seed(recipe.train.seed)
            return JointIntentSlotModel(encoder, self.intents, self.tags, pooling=recipe.task.pooling,
                                        crf=self.use_crf)

    # ------------------------------------------------------------------ encoding

    def encode(self, records: Sequence[dict[str, Any]]) -> list[Example]:
        if any(not r["tokens"] for r in records):
            raise UserError("An intent_slot record has no tokens; remove empty utterances from the data.")
        if self.clc:
            return [self._encode_words(r) for r in records]
        encoded = self.tokenizer([list(r["tokens"]) for r in records], is_split_into_words=True, truncation=True,
                                 max_length=self.max_length)
        examples = []
        for row, record in enumerate(records):
            word_ids = encoded.word_ids(row)
            first = [pos for pos, word in enumerate(word_ids)
                     if word is not None and (pos == 0 or word_ids[pos - 1] != word)]
            if not first:
                raise UserError(f"data.max_length={self.max_length} leaves no word of an utterance after the "
                                "special tokens; raise data.max_length.")
            word_tags = [self.tag_ids.get(tag, self.unknown_tag) for tag in record["tags"][:len(first)]]
            labels = [IGNORE_INDEX] * len(word_ids)
            for pos, tag in zip(first, word_tags):
                labels[pos] = tag
            extra = {"intent": self.intent_ids.get(record["intent"], self.unknown_intent), "word_index": first,
                     "word_tags": word_tags}
            if "token_type_ids" in encoded:
                extra["token_type_ids"] = encoded["token_type_ids"][row]
            examples.append(Example(input_ids=encoded["input_ids"][row], labels=labels, extra=extra))
        return examples

    def _encode_words(self, record: dict[str, Any]) -> Example:
        tokens = record["tokens"][:self.max_length]
        words, chars = self.tokenizer.encode_words(tokens)
        tags = [self.tag_ids.get(tag, self.unknown_tag) for tag in record["tags"][:len(tokens)]]
        return Example(input_ids=words, labels=tags, extra={
            "intent": self.intent_ids.get(record["intent"], self.unknown_intent), "word_index": list(range(len(words))),
            "word_tags": tags, "char_ids": chars})

    def collate(self, examples: Sequence[Example]) -> dict[str, Any]:
        width = max((len(e.input_ids) for e in examples), default=0)
        words = max((len(e.extra["word_index"]) for e in examples), default=0)
        pad = self.tokenizer.pad_token_id

        def padded(rows, length, value):
            return torch.tensor([row + [value] * (length - len(row)) for row in rows],
                                dtype=torch.long).reshape(len(rows), length)

        batch = {
            "input_ids": padded([e.input_ids for e in examples], width, pad),
            "attention_mask": padded([[1] * len(e.input_ids) for e in examples], width, 0),
            "slot_labels": padded([e.labels for e in examples], width, IGNORE_INDEX),
            "intent": torch.tensor([e.extra["intent"] for e in examples], dtype=torch.long),
            "word_index": padded([e.extra["word_index"] for e in examples], words, 0),
            "word_tags": padded([e.extra["word_tags"] for e in examples], words, IGNORE_INDEX),
            "word_mask": padded([[1] * len(e.extra["word_index"]) for e in examples], words, 0),
        }
        if examples and "token_type_ids" in examples[0].extra:
            batch["token_type_ids"] = padded([e.extra["token_type_ids"] for e in examples], width, 0)
        if examples and "char_ids" in examples[0].extra:  # (B, W, L) characters of each word
            length = max(len(c) for e in examples for c in e.extra["char_ids"])
            batch["char_ids"] = torch.stack([padded(e.extra["char_ids"] + [[]] * (width - len(e.input_ids)), length, 0)
                                             for e in examples])
        return batch

    # ------------------------------------------------------------------ loss and evaluation

    def logits(self, model: Any, batch: dict[str, Any]):
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids", "char_ids") if k in batch}
        return model(**inputs)

    def per_example_loss(self, model: Any, batch: dict[str, Any]):
        intent_logits, slot_logits = self.logits(model, batch)
        loss = per_example_loss(intent_logits, batch["intent"])
        if not self.use_crf:
            return loss + per_example_loss(slot_logits, batch["slot_labels"], reduction=self.reduction)
        known = batch["word_mask"].bool() & (batch["word_tags"] != IGNORE_INDEX)
        nll = model.crf(word_emissions(slot_logits, batch["word_index"]), batch["word_tags"], known)
        if self.reduction == "mean":
            nll = nll / known.sum(dim=1).clamp(min=1)
        return loss + nll

    def probe_batch(self, model: Any, generator: Any, batch_size: int, seq_len: int) -> dict[str, Any]:
        """Synthetic words (one per position) with random intents and tags; the CLC encoder also gets characters."""
        batch = token_batch(vocab_size(model), generator, batch_size, seq_len)
        batch["intent"] = random_labels(generator, len(self.intents), (batch_size,))
        word_tag_fields(batch, len(self.tags), generator)
        if self.clc:
            batch["char_ids"] = char_ids(batch, model.config.char_vocab, generator)
        return batch

    def predict(self, model: Any, batch: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
        """Intent names and word-level tag names (as many as the batch has words per example)."""
        intent_logits, slot_logits = self.logits(model, batch)
        emissions = word_emissions(slot_logits, batch["word_index"])
        if self.use_crf:
            tag_paths = model.crf.decode(emissions, batch["word_mask"])
        else:
            lengths = batch["word_mask"].sum(dim=1).tolist()
            tag_paths = [row[:n] for row, n in zip(emissions.argmax(-1).tolist(), lengths)]
        intents = [self.intents[i] for i in intent_logits.argmax(-1).tolist()]
        return intents, [[self.tags[t] for t in path] for path in tag_paths]

    def evaluate(self, model: Any, records: Sequence[dict[str, Any]], *, batch_size: int,
                 on_progress: Callable[[int], None] | None = None, journal: Any = None) -> dict[str, float]:
        device = next(model.parameters()).device
        intents, tags = [], []
        with evaluating(model), torch.no_grad():
            for chunk in batches(list(records), batch_size):
                batch = {k: v.to(device) for k, v in self.collate(self.encode(chunk)).items()}
                chunk_intents, chunk_tags = self.predict(model, batch)
                intents += chunk_intents
                # words cut off by max_length get no prediction: O
                tags += [words + ["O"] * (len(r["tokens"]) - len(words)) for r, words in zip(chunk, chunk_tags)]
                if on_progress:
                    on_progress(len(chunk))
        return intent_slot_scores(records, intents, tags)


def intent_slot_scores(records: Sequence[dict[str, Any]], intents: Sequence[str],
                       tags: Sequence[Sequence[str]]) -> dict[str, float]:
    """intent_acc, slot_f1, ser and sentence_acc (percent) of predictions against the records' references."""
    reference_intents = [r["intent"] for r in records]
    reference_tags = [list(r["tags"]) for r in records]
    exact = [i == r["intent"] and list(t) == list(r["tags"]) for i, t, r in zip(intents, tags, records)]
    return {
        "intent_acc": metrics.accuracy(list(intents), reference_intents),
        "slot_f1": metrics.slot_f1(tags, reference_tags),
        "ser": metrics.semantic_error_rate(
            intents, reference_intents, [metrics.slot_values(r["tokens"], t) for r, t in zip(records, tags)],
            [metrics.slot_values(r["tokens"], r["tags"]) for r in records]),
        "sentence_acc": 100.0 * sum(exact) / len(exact) if exact else 0.0,
    }
