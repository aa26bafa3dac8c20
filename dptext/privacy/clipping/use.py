"""One recorded call of a tracked layer (a *use*): what the layer's rule kept, the gradient of its output, the
privacy unit of each of its rows, and why it cannot be trusted if it cannot (``capture`` records them, ``sums``
turns them into norms and clipped sums).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from dptext.privacy.proof.in_place import INPUT_IN_PLACE, IN_PLACE


@dataclass(eq=False)
class Use:
    module: nn.Module
    rule: Any
    names: tuple[str, ...]  # the module's own parameters that the engine privatizes
    activation: Any
    units: Tensor | None = None  # the privacy unit of each row (arange(B): one example per row)
    output: Tensor | None = None  # kept only for ghost clipping's first backward pass and the probe
    grad_output: Tensor | None = None
    released: bool = False
    problem: str | None = None  # why this use's gradient cannot be trusted (found during the pass)
    version: int = 0  # the output's version counter when the layer returned it
    output_ref: Any = field(default=None, repr=False)  # set only for outputs that must not change in place
    edge: Any = field(default=None, repr=False)  # where ghost clipping's first pass takes the output gradient
    kept_versions: tuple = field(default=(), repr=False)  # (tensor, version) of what the rule kept
    # the hybrid's ghost treatment: {parameter name: (B,) squared norm} taken in the gradient hook, tensors released
    norm_sq: dict | None = field(default=None, repr=False)
    selective_checkpoint: bool = False  # recorded under selective activation checkpointing (one backward allowed)

    def in_place_problem(self) -> str | None:
        """Why an in-place change makes this use's gradient untrustworthy (seen so far), or None."""
        if self.problem in (IN_PLACE, INPUT_IN_PLACE):
            return self.problem
        output = self.output_ref() if self.output_ref is not None else None
        if output is not None and output._version != self.version:
            return IN_PLACE
        if any(kept._version != version for kept, version in self.kept_versions):
            return INPUT_IN_PLACE
        return None

    def release(self) -> None:
        """Drop the tensors now: the hook closure on the output would otherwise keep them while the graph lives."""
        self.activation = self.output = self.grad_output = self.edge = self.output_ref = None
        self.kept_versions = ()
        self.released = True

    @property
    def batch_size(self) -> int:
        """The number of units in this use's rows (the engine checks it against the loss)."""
        return -1 if self.units is None else len(self.units)
