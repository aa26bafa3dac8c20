"""``dptext check --model``: the start-up probe on a user's model, reported layer by layer.

The engine is built on the model with a throwaway SGD optimizer (σ = 0: nothing is trained), the synthetic
probe runs, and every trainable layer gets a row: its rule, exact / refused / not reached, and why. A refusal
while planning (a layer without a rule) is a row too, so the table shows everything the engine would refuse.
"""

from __future__ import annotations

from typing import Any

import torch

from dptext.errors import UserError
from dptext.models import load_model
from dptext.privacy.engine import PrivacyEngine
from dptext.privacy.proof.verify import probe


def check_model(name: str, head: str = "causal_lm", clipping_mode: str = "bookkeeping",
                clipping_layout: str = "all_layer", num_labels: int | None = None) -> dict[str, Any]:
    """{"model", "clipping_mode", "clipping_layout", "verdict", "seconds", "loss", "layers": [rows]}."""
    model, _ = load_model(name, head=head, num_labels=num_labels)
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    result = {"model": name, "clipping_mode": clipping_mode, "clipping_layout": clipping_layout}
    try:
        engine = PrivacyEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=1,
                               dataset_size=1, clipping_mode=clipping_mode, clipping_layout=clipping_layout)
    except UserError as error:  # refused while planning, before any probe
        return {**result, "verdict": "refused", "why": str(error), "seconds": 0.0, "loss": None, "layers": []}
    report = probe(engine)  # not engine.verify(): the table is wanted even when the probe refuses
    engine.detach()
    verdict = "refused" if report.refused() or report.loss_problem or report.state_problem else "exact"
    return {**result, "verdict": verdict, "seconds": round(report.seconds, 2), "loss": report.loss_problem,
            "state": report.state_problem, "layers": report.table()}
