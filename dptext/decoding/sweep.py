"""Privacy/utility sweeps: perplexity of held-out text under q' for a grid of λ (Majmudar et al. Fig. 2).

q'(y) depends on q only through q(y), so one forward pass per batch gives log q(y) for every
observed token and every λ of the sweep follows in closed form.

* Causal LMs: per-token perplexity of each text given its prefix (its first token is context
  only); ε uses T = the average number of predicted tokens per example.
* Masked LMs: the paper's protocol: mask 15% of the (non-special) tokens of each example,
  perplexity of the masked tokens, averaged over 3 maskings; T = average masked tokens per example.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from dptext.decoding.loading import CAUSAL
from dptext.decoding.mechanism import (
    check_lambda,
    epsilon_for_lambda,
    epsilon_per_token,
    perturbed_log_prob_of_targets,
)
from dptext.errors import UserError

MASK_FRACTION = 0.15
MASKINGS = 3
PAPER_GRID = "0.1:1.0:0.1"


def parse_lambdas(spec: str) -> list[float]:
    """``"0.1:1.0:0.1"`` (start:stop:step, stop included) or ``"0,0.5,0.9"`` → sorted λ values in [0, 1]."""
    try:
        if ":" in spec:
            start, stop, step = (float(part) for part in spec.split(":"))
            if not step > 0:
                raise UserError(f"The --sweep step must be > 0, got {step}.")
            count = math.floor((stop - start) / step + 1e-9) + 1
            values = [round(start + i * step, 10) for i in range(max(count, 0))]
        else:
            values = [float(part) for part in spec.split(",") if part.strip()]
    except ValueError as exc:
        raise UserError(f"Cannot read --sweep '{spec}'; write start:stop:step (e.g. 0.1:1.0:0.1) or a comma "
                        "list (e.g. 0,0.5,0.9).") from exc
    if not values:
        raise UserError(f"--sweep '{spec}' gives no λ values; e.g. 0.1:1.0:0.1.")
    return sorted({check_lambda(v, allow_one=True) for v in values})


def read_texts(path: str | Path, text_column: str = "text", max_examples: int | None = None) -> list[str]:
    """One example per line of a text file, or the ``text_column`` field of each line of a .jsonl file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"Data file '{path}' does not exist; pass a text file (one example per line) or a .jsonl file.")
    texts: list[str] = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UserError(f"{path}:{number} is not valid JSON ({exc.msg}); fix the line or use a "
                                    "plain text file.") from exc
                if not isinstance(record, dict) or text_column not in record:
                    keys = ", ".join(record) if isinstance(record, dict) else "none"
                    raise UserError(f"{path}:{number} has no '{text_column}' field (fields: {keys}); "
                                    "choose one with --text-column.")
                texts.append(str(record[text_column]))
            else:
                texts.append(line.rstrip("\n"))
            if max_examples is not None and len(texts) >= max_examples:
                break
    if not texts:
        raise UserError(f"Data file '{path}' holds no examples.")
    return texts


@dataclass(frozen=True)
class SweepRow:
    lam: float
    epsilon: float  # per query, T = tokens_per_example
    epsilon_per_token: float
    perplexity: float
    relative_increase: float  # perplexity / perplexity at λ = 1, minus 1


@dataclass(frozen=True)
class SweepResult:
    kind: str
    vocab_size: int
    examples: int
    tokens_per_example: float  # T in ε
    predicted_tokens: int  # scored tokens (over all maskings for MLMs)
    maskings: int
    baseline_perplexity: float  # λ = 1, no privacy
    rows: list[SweepRow] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def planned_batches(examples: int, batch_size: int, kind: str) -> int:
    return math.ceil(examples / batch_size) * (1 if kind == CAUSAL else MASKINGS)


def _causal_target_log_probs(model, tokenizer, texts, max_length, batch_size, on_batch):
    device = next(model.parameters()).device
    scored, vocab_size = [], None
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True, padding_side="right",
                          truncation=True, max_length=max_length).to(device)
        logits = model(**batch).logits[:, :-1].float()
        targets = batch["input_ids"][:, 1:]
        keep = batch["attention_mask"][:, 1:].bool()
        # log q(y) = z_y − logsumexp(z): avoids materialising a second B×L×|V| tensor.
        target_log_q = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(dim=-1)
        scored.append(target_log_q[keep].double().cpu())
        vocab_size = logits.shape[-1]
        on_batch()
    return [torch.cat(scored)], vocab_size


def _choose_masked_positions(candidates, generator):
    """max(1, round(15%)) of each row's candidate positions, uniformly at random. Drawn row by
    row from one generator, so the maskings do not depend on the batch size or the padding."""
    masked = torch.zeros_like(candidates)
    for row, allowed in enumerate(candidates):
        positions = allowed.nonzero().squeeze(-1)
        count = min(len(positions), max(1, round(MASK_FRACTION * len(positions))))
        masked[row, positions[torch.randperm(len(positions), generator=generator)[:count]]] = True
    return masked


def _masked_target_log_probs(model, tokenizer, texts, max_length, batch_size, seed, on_batch):
    if tokenizer.mask_token_id is None:
        raise UserError("This tokenizer has no mask token, so the masked-LM protocol cannot run; use a causal LM.")
    device = next(model.parameters()).device
    per_masking, vocab_size = [], None
    for masking in range(MASKINGS):
        generator = torch.Generator().manual_seed(seed + masking)
        scored = []
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True, truncation=True,
                              max_length=max_length, return_special_tokens_mask=True)
            candidates = batch["attention_mask"].bool() & ~batch.pop("special_tokens_mask").bool()
            masked = _choose_masked_positions(candidates, generator)
            originals = batch["input_ids"][masked]
            batch["input_ids"] = batch["input_ids"].masked_fill(masked, tokenizer.mask_token_id)
            logits = model(**batch.to(device)).logits.float()[masked.to(device)]
            scored.append(logits.log_softmax(dim=-1).gather(-1, originals.to(device).unsqueeze(-1))
                          .squeeze(-1).double().cpu())
            vocab_size = logits.shape[-1]
            on_batch()
        per_masking.append(torch.cat(scored))
    return per_masking, vocab_size


def perplexity_sweep(model, tokenizer, kind: str, texts: list[str], lambdas: list[float], max_length: int = 128,
                     batch_size: int = 16, seed: int = 0,
                     on_batch: Callable[[], None] = lambda: None) -> SweepResult:
    """Perplexity under q' for each λ, with the ε each λ costs per example. |V| = logits size."""
    with torch.inference_mode():
        if kind == CAUSAL:
            groups, vocab_size = _causal_target_log_probs(model, tokenizer, texts, max_length, batch_size, on_batch)
        else:
            groups, vocab_size = _masked_target_log_probs(model, tokenizer, texts, max_length, batch_size, seed,
                                                          on_batch)
    predicted = sum(len(g) for g in groups)
    if predicted == 0:
        raise UserError("No token of the data could be scored (every example is a single token); use longer texts.")
    tokens_per_example = predicted / (len(texts) * len(groups))

    def perplexity(lam: float) -> float:  # averaged over maskings, like the paper's 3 restarts
        return sum(math.exp(-perturbed_log_prob_of_targets(g, lam, vocab_size).mean().item())
                   for g in groups) / len(groups)

    baseline = perplexity(1.0)
    rows = [SweepRow(lam, epsilon_for_lambda(lam, vocab_size, tokens_per_example),
                     epsilon_per_token(lam, vocab_size), ppl, ppl / baseline - 1.0)
            for lam, ppl in ((lam, perplexity(lam)) for lam in lambdas)]
    return SweepResult(kind, vocab_size, len(texts), tokens_per_example, predicted, len(groups), baseline, rows)
