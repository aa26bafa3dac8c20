"""The start-up proof's cost on a real model through a task's probe batch, in DP steps (issue 42).

SmolLM2-135M (Llama architecture, tied 49k × 576 embedding), the language-modelling task's kind of synthetic batch
(random ids below the model's vocabulary size, read when drawn) and a causal-LM loss, as ``dptext finetune``
proves a model; then three DP-Adam steps of batch 8 × 64 (median). Prints one JSON line. To compare two commits,
run it from a checkout of each, alternately, on an otherwise idle machine.

    python benchmarks/probe_task_cost.py
"""

from __future__ import annotations

import json
import statistics
import time


def main() -> dict:
    import torch

    from dptext.models import load_model
    from dptext.privacy import PrivacyEngine, causal_lm_loss
    from dptext.tasks.probe_batches import token_batch, vocab_size

    model = load_model("smollm2-135m", head="causal_lm")[0].train()
    engine = PrivacyEngine(model, torch.optim.Adam(model.parameters(), lr=1e-4), noise_multiplier=1.0,
                           max_grad_norm=1.0, expected_batch_size=8, dataset_size=1000, verify=False)

    def loss(module, batch):
        return causal_lm_loss(module(**batch).logits, batch["input_ids"], batch["attention_mask"])

    start = time.perf_counter()
    engine.verify(make_batch=lambda b, t, generator: token_batch(vocab_size(model), generator, b, t), loss_fn=loss)
    probe = time.perf_counter() - start
    ids = torch.randint(1, model.config.vocab_size, (8, 64), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)

    def step() -> float:
        began = time.perf_counter()
        engine.step(causal_lm_loss(model(input_ids=ids, attention_mask=mask).logits, ids, mask))
        return time.perf_counter() - began

    median = statistics.median(step() for _ in range(3))
    row = {"model": "smollm2-135m", "probe_seconds": probe, "step_seconds": median, "probe_steps": probe / median}
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
