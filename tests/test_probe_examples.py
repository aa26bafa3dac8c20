"""The probe's numeric comparison takes two examples' brute-force gradients per batch (issue 42's cost).

Every forward keeps all the batch's rows and every example is re-drawn; only the per-example backward passes of the
reference are limited to the first (full-length) example and the most padded one, the engine's pass weighting the
others' losses by 0. A path that moves gradient into one of those zero-weighted examples, or out of them, is still
refused: the engine would give that example a norm where brute force gives exactly 0.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptext.errors import UserError
from dptext.models import load_model
from dptext.privacy import PrivacyEngine
from dptext.privacy.proof.probe_checks import compared_examples


class MoveGradient(torch.autograd.Function):
    """Identity forward; the backward adds example ``source``'s output gradient to example ``target``'s."""

    @staticmethod
    def forward(ctx, x, source, target):
        ctx.rows = source, target
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        source, target = ctx.rows
        if grad.shape[0] > max(source, target):
            grad = grad.clone()
            grad[target] += grad[source]
        return grad, None, None


def engine_for(model, mode):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return PrivacyEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=0.05, expected_batch_size=4,
                         dataset_size=100, clipping_mode=mode)


def test_the_compared_examples_are_the_full_length_one_and_the_most_padded():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    assert compared_examples({"input_ids": mask, "attention_mask": mask}, 5) == {0, 2}
    assert compared_examples({"input_ids": torch.zeros(4, 4)}, 4) == {0, 1}  # no mask: the first two
    assert compared_examples({"input_ids": torch.zeros(1, 4), "attention_mask": torch.ones(1, 4)}, 1) == {0}


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
@pytest.mark.parametrize("source, target", [(0, 3), (0, 2)])
def test_gradient_moved_out_of_a_compared_example_is_refused(mode, source, target):
    """Out of example 0 (compared) into 3 (never compared in the 5 x 3 batch: the most padded one is 1, 2 or 4),
    or into one that may be compared too. (A path that moves gradient only out of examples that are not
    compared is the one this does not see; docs/privacy_engine.md says so.)"""
    model = load_model("tiny-llama", head="causal_lm")[0].double()
    model.train()
    layer = model.model.layers[1].mlp.down_proj
    layer.register_forward_hook(lambda module, args, output: MoveGradient.apply(output, source, target))
    with pytest.raises(UserError, match="refused layer"):
        engine_for(model, mode).verify()


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
def test_a_correct_model_passes_with_two_compared_examples(mode):
    model = load_model("tiny-llama", head="causal_lm")[0].double()
    model.train()
    report = engine_for(model, mode).verify()
    assert {row.status for row in report.rows.values()} == {"exact"}
