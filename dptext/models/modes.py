"""Each module's own train/eval flag: read, put back, and evaluation mode for a while.

``model.train(was_training)`` sets every submodule to the root's flag, so a part the user keeps in eval mode on
purpose (a frozen BatchNorm inside a training model) came back from an evaluation in training mode, where its
batch statistics mix examples and its running statistics follow the private batches.
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn


def training_modes(model: nn.Module) -> tuple[bool, ...]:
    """Each module's train/eval flag, in ``modules()`` order."""
    return tuple(module.training for module in model.modules())


class ModulesChanged(ValueError):
    """The model's modules are no longer the ones whose flags were read (its forward replaced some)."""


def restore_modes(model: nn.Module, modes: tuple[bool, ...]) -> None:
    """Put back the flags ``training_modes`` read from this model (the same modules, in the same order); a model
    whose forward added or removed modules since is ``ModulesChanged``, before any flag is touched."""
    modules = list(model.modules())
    if len(modules) != len(modes):
        raise ModulesChanged(f"the model has {len(modules)} modules, {len(modes)} when its flags were read")
    for module, training in zip(modules, modes):
        module.training = training


@contextmanager
def evaluating(model: nn.Module):
    """``model`` in eval mode inside; every module's own flag restored after."""
    modes = training_modes(model)
    model.eval()
    try:
        yield model
    finally:
        restore_modes(model, modes)
