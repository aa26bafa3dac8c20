"""Evaluation mode for a while, and each module's own train/eval flag back after.

``model.train(was_training)`` sets every submodule to the root's flag, so a part the user keeps in eval mode on
purpose (a frozen BatchNorm inside a training model) came back from an evaluation in training mode, where its
batch statistics mix examples and its running statistics follow the private batches.
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn


@contextmanager
def evaluating(model: nn.Module):
    """``model`` in eval mode inside; every module's own flag restored after."""
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in flags:
            module.training = training
