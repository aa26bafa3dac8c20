"""What an attacker observes of a model on a record: its loss, a confidence and sorted output scores.

One forward pass per batch gives, per record:
* ``loss``: the task's per-example loss (same reduction as training; a test pins it to
  ``task.per_example_loss``);
* ``confidence_logit``: φ = log(p / (1 − p)) with p = exp(−mean token loss), i.e. the true class's probability
  for classification and the geometric-mean token probability of the completion for language models (the
  logit scaling of LiRA, Carlini et al. 2022);
* ``features``: what the shadow-model attack classifies. Classification: the class probabilities sorted in
  decreasing order (Shokri et al.; Dupuy et al. use sorted output scores). Language models, whose output is a
  distribution per token: the completion's per-token losses sorted and summarised by their mean and their
  0, 25, 50, 75 and 100% quantiles.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from dptext.tasks.base import batches

QUANTILES = (0.0, 0.25, 0.5, 0.75, 1.0)


def _confidence_logit(mean_loss):
    # log p − log(1 − p) with p = exp(−ℓ): −ℓ − log(−expm1(−ℓ)), stable for ℓ near 0 and large ℓ
    ell = mean_loss.clamp(min=1e-12)
    return -ell - torch.log(-torch.expm1(-ell))


def _language_model_outputs(task: Any, model: Any, batch: dict) -> tuple:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    labels = batch["labels"].clone()
    labels[batch["attention_mask"] == 0] = -100
    labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none",
                          ignore_index=-100).view(labels.shape)
    counted = labels != -100
    tokens = counted.sum(dim=1).clamp(min=1)
    mean = nll.sum(dim=1) / tokens
    loss = nll.sum(dim=1) if task.reduction == "sum" else mean
    features = []
    for row, keep in zip(nll, counted):
        values = row[keep] if keep.any() else row.new_zeros(1)
        features.append(torch.cat([values.mean().reshape(1), torch.quantile(values, torch.tensor(QUANTILES))]))
    return loss, _confidence_logit(mean), torch.stack(features)


def _classifier_outputs(task: Any, model: Any, batch: dict) -> tuple:
    logits = task.logits(model, batch).float()
    log_probs = torch.log_softmax(logits, dim=-1)
    loss = -log_probs.gather(1, batch["labels"].unsqueeze(1)).squeeze(1)
    features = torch.sort(log_probs.exp(), dim=-1, descending=True).values
    return loss, _confidence_logit(loss), features


def record_scores(task: Any, model: Any, records: Sequence[dict[str, Any]], batch_size: int = 32,
                  on_progress: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
    """{"loss", "confidence_logit", "features"} arrays for ``records`` (in order)."""
    device = next(model.parameters()).device
    outputs = _classifier_outputs if hasattr(task, "logits") else _language_model_outputs
    parts: dict[str, list] = {"loss": [], "confidence_logit": [], "features": []}
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for chunk in batches(task.encode(records), batch_size):
            batch = {k: v.to(device) for k, v in task.collate(chunk).items()}
            for name, value in zip(parts, outputs(task, model, batch)):
                parts[name].append(value.detach().cpu().numpy())
            if on_progress:
                on_progress(len(chunk))
    model.train(was_training)
    return {name: np.concatenate(values) if values else np.zeros(0) for name, values in parts.items()}
