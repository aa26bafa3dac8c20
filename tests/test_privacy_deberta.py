"""DeBERTa-v2/v3 relative positions (dptext/privacy/norms/deberta_relative.py) in training mode, with dropout.

The architecture matrix checks the tiny models in eval mode against brute force; here the start-up probe (which
compares with per-example autograd on the model's own forward, same dropout masks) must pass in train mode with
dropout on, in every mode and layout: the per-example chain draws the model's one position-dropout mask for the
whole batch. Removing one example then moves the clipped sum by at most C (in eval mode).
"""

from __future__ import annotations

import pytest
import torch

from arch_cases import BY_NAME, NO_DROPOUT, build
from dptext.privacy.proof.synthetic import synthetic_token_batch
from test_privacy_failclosed import CASES, assert_sensitivity, make_engine


FAST = {("deberta_v3", "bookkeeping", "all_layer"), ("deberta_v3", "ghost", "all_layer"),
        ("deberta_v3", "per_sample", "per_layer"), ("deberta_v2", "bookkeeping", "per_layer")}
CELLS = [pytest.param(name, mode, layout, marks=() if (name, mode, layout) in FAST else pytest.mark.slow)
         for name in ("deberta_v2", "deberta_v3") for mode, layout in CASES]


@pytest.mark.parametrize("name,mode,layout", CELLS)
def test_deberta_relative_positions_pass_the_probe_with_dropout(name, mode, layout, monkeypatch):
    monkeypatch.setitem(NO_DROPOUT, "hidden_dropout_prob", 0.2)  # pos_dropout and the hidden dropouts
    model = build(BY_NAME[name]).train()
    assert model.deberta.encoder.layer[0].attention.self.pos_dropout.p == 0.2
    engine, _ = make_engine(model, mode, layout)
    assert "get_rel_embedding" in vars(model.deberta.encoder)  # the per-example chain is installed
    engine.verify()  # raises (naming the layer) on any mismatch with per-example autograd
    model.eval()  # dropout off: with it, removing an example would also change the others' masks
    assert_sensitivity(engine, synthetic_token_batch(model)(5, 7, torch.Generator().manual_seed(5)))
    engine.detach()
    assert "get_rel_embedding" not in vars(model.deberta.encoder)  # the engine's patches are undone
