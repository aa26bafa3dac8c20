"""Red-team regressions for the step checks of eDP-SGD (a gradient the engine did not issue) and DPTrainer's
refusal to evaluate on the training rows. Each test failed on the code it was written against; tiny models and
datasets built in code."""

from __future__ import annotations

import pytest
import torch

from dptext.errors import UserError
from test_edp_redteam import engine_for


@pytest.mark.parametrize("write", ["in_place", "assigned"])
def test_a_foreign_gradient_written_through_grad_data_is_refused(write):
    """.grad.data shares .grad's memory but not its version counter: other examples' gradient added (or assigned)
    through it between a unit's chunks joined the unit's clip unseen, 4C where 2C is accounted."""
    model, _, engine = engine_for(noise_multiplier=0.0)
    x = torch.randn(6, 4)
    engine.accumulate(model(x[:2]).pow(2).sum(1))  # the unit's first chunk
    foreign = torch.autograd.grad(model(x[2:]).pow(2).sum(), model.weight)[0]  # other examples
    if write == "in_place":
        model.weight.grad.data.add_(foreign)
    else:
        model.weight.grad.data = model.weight.grad + foreign
    with pytest.raises(UserError, match="not issued by the engine"):
        engine.close_unit()
    assert engine.clipped_grads() == {}
