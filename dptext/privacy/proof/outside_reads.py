"""Every step in ghost mode: no tracked parameter is read outside the modules that own it (issue 14, pattern 3).

Ghost clipping takes each example's norm from the recorded layer calls (first backward pass) but its clipped sum
from autograd (second pass), which follows *every* path to a parameter. A parameter also read outside the modules
that own it — ``F.linear(h, self.embed.weight)`` as an LM head, a weight read by a second module through an
attribute, plain functional code — adds a path the norms miss, so examples would be clipped by too small a norm.

The check is structural and cheap (no extra pass, no numbers from the batch). Autograd numbers the nodes it
creates in creation order (``Node._sequence_nr``). A forward pre-hook and a forward hook on every tracked module
bracket each call with two such numbers (the call's *window*). Before the first backward pass the graph is walked
once from the loss: every node that reads a tracked parameter — has an edge into its ``AccumulateGrad``, or into
a cast / view / transpose of it (autocast caches a weight's cast across calls) — must have been created inside a
window of a module that owns the parameter; the first one that was not stops the step, naming the parameter.
The walk visits each node once: O(nodes of the graph) Python work.

Book-keeping and per_sample take the parameters out of autograd (``requires_grad=False``), so such a read gets no
gradient at all and no ``AccumulateGrad`` to find. That is a dropped path, not a leak: norms and clipped sums are
formed from the same recorded calls, so each example still contributes at most C (docs/privacy_engine.md). The
start-up probe refuses it in every mode (the norms differ from brute-force autograd, and its TorchFunctionMode
sees the read).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def _accumulate_grad_type() -> type:
    leaf = torch.zeros((), requires_grad=True)
    return type(leaf.view_as(leaf).grad_fn.next_functions[0][0])


ACCUMULATE_GRAD = _accumulate_grad_type()
# Backward nodes of ops that only re-express one tensor (no other input, no arithmetic with activations)
RE_EXPRESSIONS = {"ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
                  "UnsafeViewBackward0", "AliasBackward0", "ExpandBackward0", "ReshapeAliasBackward0"}


class OutsideReads:
    """Records each tracked module call's window of autograd sequence numbers; ``outside_read(loss)`` walks the
    graph (see the module docstring). Install with ``install()``, remove with ``remove()``."""

    def __init__(self, model: nn.Module, tracked: dict[nn.Module, tuple[Any, tuple[str, ...]]]):
        self.owners: dict[nn.Parameter, list[nn.Module]] = {}
        self._planned = {module: [(name, module.get_parameter(name)) for name in names]
                         for module, (_, names) in tracked.items()}
        for module, planned in self._planned.items():
            for _, param in planned:
                self.owners.setdefault(param, []).append(module)
        self.windows: dict[nn.Module, list[tuple[int, int]]] = {}
        self._open: list[int] = []
        self._by_id = {id(param): param for param in self.owners}
        self._kinds: dict[type, bool] = {}  # backward node class → is it a re-expression (RE_EXPRESSIONS)
        self._marker = torch.zeros((), requires_grad=True)
        self._handles = [model.register_forward_pre_hook(self._on_model_call)]
        for module in tracked:
            self._handles.append(module.register_forward_pre_hook(self._enter, prepend=True))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self.clear()

    def clear(self) -> None:
        self.windows, self._open = {}, []

    def _now(self) -> int | None:
        """The next sequence number autograd will hand out (a throwaway node takes the current one); None inside a
        torch.func transform (the engine's own per-example replay), which builds no graph the walk would see."""
        node = self._marker.view_as(self._marker).grad_fn
        return None if node is None else node._sequence_nr()

    def _on_model_call(self, module: nn.Module, args: tuple) -> None:
        self.clear()  # windows of earlier forwards cannot hold nodes of this one (numbers only grow)

    def _enter(self, module: nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled():
            self._alias_gathered(module)
            self._open.append(self._now())

    def _alias_gathered(self, module: nn.Module) -> None:
        """FSDP2 swaps a module's sharded parameters for gathered ones (other objects) during its call, and the
        graph reads those: they count as the planned parameter, with its owners (kept referenced: ids stay unique)."""
        for name, planned in self._planned[module]:
            try:
                current = module.get_parameter(name)
            except AttributeError:  # a plain tensor in its place (torch.func's functional_call): not a parameter
                continue
            if current is not planned and id(current) not in self._by_id:
                self.owners[current] = self.owners[planned]
                self._by_id[id(current)] = planned

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:  # returns None: output unchanged
        if torch.is_grad_enabled() and self._open:
            start, end = self._open.pop(), self._now()
            if start is not None and end is not None:
                self.windows.setdefault(module, []).append((start, end))

    def outside_read(self, loss: Tensor) -> nn.Parameter | None:
        """The first tracked parameter read by a node created outside every window of its owners, else None."""
        root = loss.grad_fn
        if root is None:
            return None
        # keyed by id(): Tensor.__hash__ goes through torch's Python dispatch and dominated the walk's cost
        allowed = {id(param): [w for m in owners for w in self.windows.get(m, ())]
                   for param, owners in self.owners.items()}
        sources: dict[Any, int | None] = {}
        seen, stack = {root}, [root]
        while stack:
            node = stack.pop()
            for child, _ in node.next_functions:
                if child is None:
                    continue
                kind = type(child)
                if kind is ACCUMULATE_GRAD:
                    param = id(child.variable)
                elif self._re_expression(kind):
                    param = self._source(child, sources)
                else:
                    param = None
                if param in allowed:  # ``node`` reads a tracked parameter: it must lie in an owner's call
                    number = node._sequence_nr()
                    if not any(start < number < end for start, end in allowed[param]):
                        return self._by_id[param]
                elif kind is not ACCUMULATE_GRAD and child not in seen:
                    seen.add(child)
                    stack.append(child)
        return None

    def _re_expression(self, kind: type) -> bool:
        if kind not in self._kinds:
            self._kinds[kind] = kind.__name__ in RE_EXPRESSIONS
        return self._kinds[kind]

    def _source(self, node: Any, sources: dict) -> int | None:
        """The id of the tracked parameter that ``node`` only re-expresses (a cast, view or transpose of it, down to its
        AccumulateGrad), else None. Casts count because autocast caches a weight's cast: a read outside the module
        reuses the cast node made inside it, so the reader is whoever reads the cast."""
        if node not in sources:
            inputs = [child for child, _ in node.next_functions if child is not None]
            result = None
            if len(inputs) == 1 and type(inputs[0]) is ACCUMULATE_GRAD:
                result = id(inputs[0].variable) if id(inputs[0].variable) in self._by_id else None
            elif len(inputs) == 1 and self._re_expression(type(inputs[0])):
                result = self._source(inputs[0], sources)
            sources[node] = result
        return sources[node]
