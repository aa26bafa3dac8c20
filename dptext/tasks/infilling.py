"""Classification as text infilling with a masked-LM head (Li et al. §3.2, App. N; SPEC §8).

The input is written into a template with one [MASK], e.g. SST-2 "<S1> It was [MASK] .", and the
class is the label word ("terrible" / "great") whose MLM logit at the mask is highest. Training
uses cross-entropy over the label words' logits only, so the pretrained MLM head is the
classifier: no new parameters, which is why infilling beats a fresh head under DP.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from dptext.errors import UserError
from dptext.tasks.base import Task
from dptext.tasks.classification import ClassificationTask
from dptext.tasks.encoding import Example
from dptext.tasks.probe_batches import mask_one_position

SENTIMENT = ("<S1> It was [MASK] .", ("terrible", "great"))  # label 0 = negative, 1 = positive
TEMPLATES = {
    "sst2": SENTIMENT,
    "imdb": SENTIMENT,
    "amazon": SENTIMENT,
    "qnli": ("<S1> ? [MASK] , <S2>", ("Yes", "No")),  # entailment, not_entailment
    "mnli": ("<S1> ? [MASK] , <S2>", ("Yes", "Maybe", "No")),  # entailment, neutral, contradiction
    "qqp": ("<S1> [MASK] , <S2>", ("No", "Yes")),  # not_duplicate, duplicate
}


def template_for(dataset: str, template: str | None, label_words: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    default = TEMPLATES.get(dataset)
    if (template is None or not label_words) and default is None:
        raise UserError(f"There is no default infilling template for dataset '{dataset}'; set task.template "
                        "(e.g. '<S1> It was [MASK] .') and task.label_words in label order.")
    template = template or default[0]
    words = tuple(label_words) or default[1]
    if template.count("[MASK]") != 1 or "<S1>" not in template:
        raise UserError(f"Infilling template '{template}' needs exactly one [MASK] and the sentence slot <S1>.")
    return template, words


def label_word_ids(tokenizer: Any, words: Sequence[str]) -> list[int]:
    """One token id per label word; with a leading space first (BPE vocabularies mark word starts)."""
    ids = []
    for word in words:
        for candidate in (" " + word, word):
            pieces = tokenizer(candidate, add_special_tokens=False)["input_ids"]
            if len(pieces) == 1:
                ids.append(pieces[0])
                break
        else:
            raise UserError(f"Label word '{word}' is not a single token for this tokenizer; choose single-token "
                            "words with task.label_words.")
    if len(set(ids)) != len(ids):
        raise UserError(f"Label words {list(words)} map to repeated tokens; choose distinct words.")
    return ids


class InfillingTask(ClassificationTask):
    head = "masked_lm"

    def __init__(self, recipe: Any, tokenizer: Any, train_records: Sequence[dict[str, Any]]):
        super().__init__(recipe, tokenizer, train_records)
        if recipe.task.pooling != "model":
            raise UserError("task.pooling applies to classification heads; infilling predicts at the [MASK] "
                            "token, so leave task.pooling at its default.")
        if tokenizer.mask_token is None:
            raise UserError("Text infilling needs a tokenizer with a mask token; use an MLM model "
                            "(roberta-base, tiny-roberta) or task.type=classification.")
        self.template, self.words = template_for(recipe.data.dataset, recipe.task.template, recipe.task.label_words)
        if len(self.words) != self.num_labels:
            raise UserError(f"The template has {len(self.words)} label words but the data has {self.num_labels} "
                            "classes; give one task.label_words entry per class.")
        self.word_ids = label_word_ids(tokenizer, self.words)
        # Tokens the template itself takes (specials, literal words, the mask): the same for every record.
        self.template_length = len(tokenizer(self._fill("", ""))["input_ids"])

    def load_model(self):
        return Task.load_model(self)  # the pretrained MLM head is the classifier: no pooling head

    def _fill(self, first: str, second: str) -> str:
        text = self.template.replace("[MASK]", self.tokenizer.mask_token)
        return text.replace("<S1>", first).replace("<S2>", second)

    def _truncate(self, first: str, second: str) -> tuple[str, str]:
        """Shorten the longer sentence until the filled template fits ``max_length`` (the mask must survive)."""
        budget = max(self.max_length - self.template_length, 0)
        tokens = [self.tokenizer(s, add_special_tokens=False)["input_ids"] for s in (first, second)]
        if len(tokens[0]) + len(tokens[1]) <= budget:
            return first, second
        while len(tokens[0]) + len(tokens[1]) > budget:
            longer = 0 if len(tokens[0]) >= len(tokens[1]) else 1
            excess = len(tokens[0]) + len(tokens[1]) - budget
            tokens[longer] = tokens[longer][:max(len(tokens[longer]) - excess, 0)]
        return self.tokenizer.decode(tokens[0]), self.tokenizer.decode(tokens[1])

    def encode(self, records: Sequence[dict[str, Any]]) -> list[Example]:
        mask = self.tokenizer.mask_token
        examples = []
        for record in records:
            if record.get("label") is None:
                raise UserError("A record without a label reached training or evaluation; use a labelled split.")
            # A literal mask token inside user text would create a second [MASK].
            first = record["text"].replace(mask, "")
            second = (record.get("text_pair") or "").replace(mask, "")
            ids = self.tokenizer(self._fill(*self._truncate(first, second)))["input_ids"]
            positions = [i for i, t in enumerate(ids) if t == self.tokenizer.mask_token_id]
            if len(positions) != 1:  # pragma: no cover - guarded above; a tokenizer quirk would land here
                raise UserError("The filled infilling template does not contain exactly one mask token.")
            examples.append(Example(input_ids=ids[:self.max_length], labels=[],
                                    extra={"label": self.label_index(record), "mask_position": positions[0]}))
        return examples

    def collate(self, examples: Sequence[Example]) -> dict[str, Any]:
        batch = super().collate(examples)
        batch["mask_position"] = torch.tensor([e.extra["mask_position"] for e in examples], dtype=torch.long)
        return batch

    def probe_batch(self, model: Any, generator: Any, batch_size: int, seq_len: int) -> dict[str, Any]:
        batch = super().probe_batch(model, generator, batch_size, seq_len)
        mask_one_position(batch, self.tokenizer.mask_token_id, generator)
        return batch

    def logits(self, model: Any, batch: dict[str, Any]):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        at_mask = out[torch.arange(out.shape[0], device=out.device), batch["mask_position"]]
        return at_mask[:, self.word_ids]
