"""Hooks that record, for every call of a layer with a rule, what its per-example gradients are made of.

Each call of a tracked module in a forward pass is one *use*: the forward hook keeps the activation the rule
asks for, and a tensor hook on the call's output keeps the gradient of the loss with respect to that output
when the backward pass reaches it. A module called twice (or two modules sharing a parameter) gives two uses;
the clipping code adds their cross terms.

Two details keep the per-example gradients per example:
* A module fed a batch of one while the model's batch is larger (GPT-2 and BERT look up position
  embeddings for one row of position ids and broadcast the result) has its input expanded to the whole batch,
  so each example's output gradient stays its own instead of being summed over the batch by broadcasting.
* Where the layer's parameters do not require grad during the pass (book-keeping and per-sample modes skip
  autograd's weight gradients) and nothing upstream does either, the output is marked as requiring grad so
  that the backward pass still reaches it.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dptext.errors import UserError

BATCH_KEYS = ("input_ids", "inputs_embeds", "pixel_values", "input_values")


@dataclass(eq=False)
class Use:
    module: nn.Module
    rule: Any
    names: tuple[str, ...]  # the module's own parameters that the engine privatizes
    activation: Any
    output: Tensor | None = None  # kept only for ghost clipping's first backward pass
    grad_output: Tensor | None = None
    released: bool = False

    def release(self) -> None:
        """Drop the tensors now: the hook closure on the output would otherwise keep them while the graph lives."""
        self.activation = self.output = self.grad_output = None
        self.released = True

    @property
    def batch_size(self) -> int:
        activation = self.activation[0] if isinstance(self.activation, tuple) else self.activation
        return activation.shape[0]


def _batch_size(args: tuple, kwargs: dict) -> int | None:
    for key in BATCH_KEYS:
        if isinstance(kwargs.get(key), Tensor):
            return kwargs[key].shape[0]
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, Tensor) and value.ndim > 0:
            return value.shape[0]
    return None


class UseRecorder:
    """Installs the hooks on ``root`` and the tracked modules; ``uses`` fills up during forward passes."""

    def __init__(self, root: nn.Module, tracked: dict[nn.Module, tuple[Any, tuple[str, ...]]],
                 keep_outputs: bool = False):
        self.tracked = tracked
        self.keep_outputs = keep_outputs
        self.uses: list[Use] = []
        self.batch_size: int | None = None
        self.recording = True
        self.names = {module: name for name, module in root.named_modules()}
        self._handles = [root.register_forward_pre_hook(self._on_model_call, with_kwargs=True)]
        for module, (rule, _) in tracked.items():
            if hasattr(rule, "install"):  # a rule that records its uses itself (a table shared by the batch)
                self._handles.extend(rule.install(module, self, root))
                continue
            self._handles.append(module.register_forward_pre_hook(self._expand_broadcast_batch))
            self._handles.append(module.register_forward_hook(self._on_layer_call, with_kwargs=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self.uses.clear()

    def take_uses(self) -> list[Use]:
        """The uses whose output received a gradient; forgets them all (their tensors can be freed)."""
        uses = [use for use in self.uses if use.grad_output is not None]
        self.uses = []
        return uses

    @contextmanager
    def paused(self):
        """No recording while the engine itself calls layers (the torch.func fallback re-runs them)."""
        self.recording = False
        try:
            yield
        finally:
            self.recording = True

    def outputs(self) -> list[Tensor]:
        return [use.output for use in self.uses if use.output is not None]

    def active(self) -> bool:
        return self.recording and torch.is_grad_enabled()

    def _on_model_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.active():
            self.batch_size = _batch_size(args, kwargs)

    def _expand_broadcast_batch(self, module: nn.Module, args: tuple):
        if not self.active() or not args or not isinstance(args[0], Tensor):
            return None
        first = args[0]
        if first.ndim > 0 and first.shape[0] == 1 and (self.batch_size or 1) > 1:
            if first.is_floating_point():
                # Ids looked up for one row and broadcast (positions) expand safely; a shared float input (DeBERTa's
                # relative-position embeddings) is reshaped downstream by its batch size, and its per-example
                # gradients are summed by the broadcast, so neither expanding nor recording it would be right.
                raise UserError(f"Layer '{self.names.get(module, type(module).__name__)}' "
                                f"({type(module).__name__}) is applied to a tensor shared by the whole batch, so one "
                                "example's gradient cannot be separated from the others'; freeze it "
                                "(requires_grad_(False)) or leave it out of the LoRA targets.")
            return (first.expand(self.batch_size, *first.shape[1:]),) + args[1:]
        return None

    def _on_layer_call(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not self.active():
            return None
        if not isinstance(output, Tensor):
            raise TypeError(f"{type(module).__name__} returned {type(output).__name__}; the privacy engine "
                            "tracks layers that return one tensor.")
        rule, names = self.tracked[module]
        if not output.requires_grad:
            output.requires_grad_(True)  # a leaf: the layer's weights are excluded from autograd in this pass
        with torch.no_grad():  # what we keep feeds our own arithmetic, never autograd's graph
            detached = tuple(x.detach() if isinstance(x, Tensor) else x for x in args)
            # A rule that derives its inputs from keyword arguments (position_ids, DoRA's adapters) has keep_call.
            if hasattr(rule, "keep_call"):
                kept = rule.keep_call(module, detached, kwargs)
            else:
                kept = rule.keep(module, detached)
        if hasattr(rule, "broadcast_output"):  # one output row shared by the batch: one view per example (BART)
            output = rule.broadcast_output(module, output, kept)
        self.record(module, rule, kept, output)
        return output

    def record(self, module: nn.Module, rule: Any, kept: Any, output: Tensor, grad_view=None) -> Use:
        """One use of ``module``: what its rule kept, and a hook that keeps the gradient reaching ``output``
        (reshaped by ``grad_view`` for rules whose rows are regrouped by example)."""
        use = Use(module, rule, self.tracked[module][1], kept, output if self.keep_outputs else None)

        def keep_grad(grad: Tensor) -> None:
            if use.grad_output is None and not use.released:
                use.grad_output = grad if grad_view is None else grad_view(grad)

        output.register_hook(keep_grad)
        self.uses.append(use)
        return use
