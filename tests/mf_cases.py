"""What the correlated-noise engine tests share (banded MF and BLT, ``tests/test_privacy_banded_mf.py`` and
``tests/test_privacy_blt.py``): the noise each step adds, and the release C·G of a tiny model's clipped sums with
and without one example, for the remove-one-example sensitivity test, and the refusals every such engine makes."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from dptext.errors import UserError
from dptext.privacy import per_example_loss


def noise_of_steps(engine, steps: int) -> np.ndarray:
    """Each step's added noise (the privatized gradient of an empty batch, times B): steps × coordinates."""
    rows = []
    for _ in range(steps):
        grads = engine.dp_optimizer.privatized_grads()
        rows.append(torch.cat([g.flatten() for g in grads.values()]).double().numpy() * engine.expected_batch_size)
    return np.stack(rows)


def release_of(base: nn.Module, dataset: dict[int, torch.Tensor], drop: int | None, make_engine,
               strategy: np.ndarray):
    """C·G for the clipped sums G of each step (σ = 0, lr = 0: the weights stay put), without example ``drop``;
    ``make_engine(model, optimizer, dataset_size)`` builds the engine, ``strategy`` is its C as a dense matrix.
    (The clipped sums' exactness is the start-up probe's business, tested elsewhere: not re-run here.)"""
    model = copy.deepcopy(base)
    engine = make_engine(model, torch.optim.SGD(model.parameters(), lr=0.0), len(dataset))
    rows = []
    for batch in engine.sampler():  # the same bins for the others in both worlds (the coupling of add/remove)
        chosen = [i for i in batch if i != drop]
        if chosen:
            ids = torch.stack([dataset[i] for i in chosen])
            logits = model(input_ids=ids).logits
            engine.accumulate(per_example_loss(logits, ids, torch.ones_like(ids), shift=True))
        sums = engine.clipped_grads()
        rows.append(torch.cat([sums.get(p, torch.zeros_like(p)).flatten() for p in engine.params]).double())
        engine.step()
    return strategy @ torch.stack(rows).numpy(), engine


def check_lifecycle_refusals(engine, label: str) -> None:
    """A 2-step engine refuses what its accounting does not cover: a new trainable set once noise has been drawn,
    a third step, user-level sampling, and a sampler for another number of steps."""
    engine.step()
    with pytest.raises(UserError, match="trainable set"):
        engine.replan(verify=False)
    engine.step()
    with pytest.raises(UserError, match="accounted for 2 steps"):
        engine.step()
    with pytest.raises(UserError, match=f"User-level DP with {label}"):
        engine.user_sampler([[0]], 1, 2)
    with pytest.raises(UserError, match="not 5"):
        engine.sampler(5)
