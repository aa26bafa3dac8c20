"""A degenerate noise multiplier is refused by the library's engines at construction, as by the recipe (issue 43)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptext.errors import UserError
from dptext.privacy import EDPEngine, PrivacyEngine


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 3))


def build(engine_class, sigma: float):
    net = model()
    batch = {"expected_batch_size": 4} if engine_class is PrivacyEngine else {"sample_rate": 0.04}
    return engine_class(net, torch.optim.SGD(net.parameters(), lr=0.1), noise_multiplier=sigma, max_grad_norm=1.0,
                        dataset_size=100, verify=False, **batch)


@pytest.mark.parametrize("engine_class, floor", [(PrivacyEngine, "0.03"), (EDPEngine, "0.06")])
def test_a_noise_multiplier_between_zero_and_the_accountants_floor_is_refused(engine_class, floor):
    with pytest.raises(UserError, match=f"below {floor}"):  # eDP-SGD accounts z_0 / 2
        build(engine_class, 1e-9)


@pytest.mark.parametrize("sigma", [0.0, 0.03, 1.0])
def test_zero_and_ordinary_noise_multipliers_are_accepted(sigma):
    assert build(PrivacyEngine, sigma).noise_multiplier == sigma
