"""Hooks that record, for every call of a layer with a rule, what its per-example gradients are made of.

Each call of a tracked module in a forward pass is one *use*: the forward hook keeps the activation the rule
asks for, and a tensor hook on the call's output keeps the gradient of the loss with respect to that output
when the backward pass reaches it. A module called twice (or two modules sharing a parameter) gives two uses;
the clipping code adds their cross terms.

Fail closed (SPEC §2 (a)–(c), docs/privacy_engine.md):
* **Rows → units.** The number of examples comes from the model's own inputs (``input_ids`` …, recorded by a
  pre-hook on the model), never from a layer's shape. Each use carries ``units``, the privacy unit of each of its
  rows (``arange(B)``: one example per row); a use whose rows are not the batch's examples (experts fed gathered
  tokens, a sequence-first layer) stops the step naming the layer. With user-level DP the engine maps these rows
  on to users before clipping (``privacy/clipping/units.py``: a unit's rows summed with Gram cross terms, as tied
  weights).
* **Our hook runs first** (``prepend=True``) and binds keyword inputs to the forward's signature, so the recorded
  output is the one the weight produced, even when other hooks rewrite it afterwards; a module called with more
  inputs than its rule describes is refused unless the start-up probe verified it (``verified``).
* **In-place changes** (``in_place.py``): exact where autograd's hook semantics make them so, refused otherwise.
* A module fed a batch of one while the model's batch is larger (GPT-2 and BERT look up position embeddings
  for one row of position ids) has its input expanded to the whole batch so each example's output gradient stays
  its own; the probe checks that this leaves the forward unchanged (``expansions``).
* Where the layer's parameters do not require grad during the pass (book-keeping and per-sample modes) and
  nothing upstream does either, the output is put in the graph (``in_place.in_graph``) so the backward pass
  still reaches it.
"""

from __future__ import annotations

import inspect
import weakref
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from dptext.errors import UserError
from dptext.privacy.clipping.call_checks import (foreign_code_at_call, selective_checkpoint_at_call, subclass_at_call,
                                                 subclass_in_batch, weights_at_call)
from dptext.privacy.clipping.use import Use
from dptext.privacy.proof.in_place import INPUT_IN_PLACE, IN_PLACE, gradient_site, in_graph, tensors_in
from dptext.privacy.norms import MODEL_PATCHES

BATCH_KEYS = ("input_ids", "inputs_embeds", "pixel_values", "input_values")


def model_batch_size(args: tuple, kwargs: dict) -> int | None:
    """The number of examples, read from the model's inputs: a known input key, else the first tensor argument."""
    for key in BATCH_KEYS:
        if isinstance(kwargs.get(key), Tensor):
            return kwargs[key].shape[0]
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, Tensor) and value.ndim > 0:
            return value.shape[0]
    return None


def bind_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """The call's inputs as positional arguments in the forward's order (``layer(input=x)`` → ``(x,)``)."""
    if not kwargs:
        return args
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError:
        return args + tuple(kwargs.values())
    return tuple(bound.arguments.values())


def hook_keys(module: nn.Module) -> tuple:
    # torch has no public way to list a module's hooks; the handles' ids in these dicts say which are there.
    return tuple(module._forward_pre_hooks), tuple(module._forward_hooks)


def _detached(values) -> tuple:
    return tuple(x.detach() if isinstance(x, Tensor) else x for x in values)


class UseRecorder:
    """Installs the hooks on ``root`` and the tracked modules; ``uses`` fills up during forward passes.

    ``names`` maps modules to their dotted names (for messages); ``verified`` holds the modules the start-up
    probe checked numerically, for which calls with extra inputs are accepted."""

    def __init__(self, root: nn.Module, tracked: dict[nn.Module, tuple[Any, tuple[str, ...]]],
                 keep_outputs: bool = False, names: dict[nn.Module, str] | None = None):
        self.tracked = tracked
        self.keep_outputs = keep_outputs
        self.names = names or {}
        self.verified: set[nn.Module] = set()
        self.probing = False  # the probe keeps outputs and expansions and lets unverified calls through
        self.batch_problem: str | None = None  # a tensor subclass in the model call's inputs (``call_checks``)
        self.uses: list[Use] = []
        self.expansions: list[tuple[nn.Module, tuple, Tensor]] = []
        self.batch_size: int | None = None
        self.recording = True
        self._expanded: set[nn.Module] = set()
        self._pending: list[Use] = []  # uses of the running forward, output held until the model returns
        # the hybrid's pass 1 (``clipping/hybrid.py``): called with each use as its output gradient arrives, it may
        # take the use's norm there and release its tensors (a layer under the ghost treatment)
        self.norm_in_hook = None
        self.global_hooks: tuple | None = None  # torch's global module hooks at the plan (``engine_plan``)
        self.names = names or {module: name for name, module in root.named_modules()}
        self._handles = [root.register_forward_pre_hook(self._on_model_call, with_kwargs=True),
                         root.register_forward_hook(self._on_model_return)]
        for module, (rule, _) in tracked.items():
            if hasattr(rule, "install"):  # a rule that records its uses itself (a table shared by the batch, rows
                self._handles.extend(rule.install(module, self, root))  # regrouped by example): via record()
                continue
            self._handles.append(module.register_forward_pre_hook(self._expand_broadcast_batch, prepend=True))
            self._handles.append(module.register_forward_hook(self._on_layer_call, with_kwargs=True, prepend=True))
        for patch in MODEL_PATCHES:  # shared paths rewritten to meet the batch first (DeBERTa's positions)
            self._handles.extend(patch(root, self))
        self.hook_keys = {module: hook_keys(module) for module in tracked}

    def hooks_changed(self, module: nn.Module) -> bool:
        """Forward hooks added or removed on ``module`` since the plan (one registered later with prepend=True
        would run before ours and rewrite the output we record)."""
        return hook_keys(module) != self.hook_keys[module]

    def add_handle(self, handle) -> None:
        """A hook of the engine's own on the model, removed with the recorder's."""
        self._handles.append(handle)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self.uses.clear()

    def take_uses(self) -> list[Use]:
        """The uses whose output received a gradient; forgets them all (their tensors can be freed)."""
        for use in self.uses:  # last look for in-place changes, before anything is computed from the uses
            use.problem = use.problem or use.in_place_problem()
        # A view changed in place can lose its gradient hook altogether: keep such uses so the step stops. A use whose
        # norm was taken in its gradient hook (the hybrid's ghost treatment) received its gradient and released it.
        uses = [use for use in self.uses if use.grad_output is not None or use.norm_sq is not None
                or use.problem in (IN_PLACE, INPUT_IN_PLACE)]
        self.uses, self.expansions, self._pending = [], [], []
        return uses

    @contextmanager
    def paused(self):
        """No recording while the engine itself calls layers (the torch.func fallback, the probe's reference)."""
        self.recording = False
        try:
            yield
        finally:
            self.recording = True

    def outputs(self) -> list:
        """Where ghost clipping's first pass takes each kept output's gradient: the gradient edge of the hooked
        tensor as it was when recorded (an output changed in place since has a new node, bypassing our hook)."""
        return [use.edge for use in self.uses if use.output is not None and use.edge is not None]

    def active(self) -> bool:
        return self.recording and torch.is_grad_enabled()

    def _on_model_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.active():
            self.batch_size = model_batch_size(args, kwargs)
            self.batch_problem = None if self.probing else subclass_in_batch(args, kwargs)

    def _on_model_return(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._check_pending()

    def _check_pending(self) -> None:
        """In-place changes that make a use untrustworthy (an output that is a view changed in place, an input
        changed after the layer read it), checked for the last uses when the next tracked layer is called or the
        model returns; outputs are then dropped unless ghost clipping or the probe needs them. Later changes are
        seen by the gradient hook and before clipping (``take_uses``), and always by the start-up probe."""
        for use in self._pending:
            use.problem = use.problem or use.in_place_problem()
            if not (self.keep_outputs or self.probing):
                use.output = None
        self._pending = []

    def _expand_broadcast_batch(self, module: nn.Module, args: tuple):
        if self._pending:
            self._check_pending()
        if not self.active() or not args or not isinstance(args[0], Tensor):
            return None
        first = args[0]
        if first.ndim > 0 and first.shape[0] == 1 and (self.batch_size or 1) > 1:
            if first.is_floating_point():
                # Ids looked up for one row and broadcast (positions) expand safely; a shared float input may be
                # reshaped downstream by its batch size (DeBERTa's relative positions, which a model patch
                # computes per example instead), and its per-example gradients are summed by the broadcast, so
                # neither expanding nor recording it would be right.
                raise UserError(f"Layer '{self._name(module)}' ({type(module).__name__}) is applied to a tensor "
                                "shared by the whole batch, so one example's gradient cannot be separated from the "
                                "others'; freeze it (requires_grad_(False)) or leave it out of the LoRA targets.")
            self._expanded.add(module)
            if self.probing:
                self.expansions.append((module, args, None))
            return (first.expand(self.batch_size, *first.shape[1:]),) + args[1:]
        return None

    def _name(self, module: nn.Module) -> str:
        return self.names.get(module, type(module).__name__)

    def _on_layer_call(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not self.active():
            return None
        rule, names = self.tracked[module]
        if not isinstance(output, Tensor):
            raise UserError(f"Layer '{self._name(module)}' ({type(module).__name__}) returned "
                            f"{type(output).__name__}, but its rule describes a layer returning one tensor; "
                            f"freeze its own parameters ({', '.join(names)}) or train the model through LoRA.")
        inputs = args + tuple(kwargs.values()) if getattr(rule, "takes_keywords", False) else \
            bind_inputs(module, args, kwargs)
        # rules that read their inputs from the call themselves (keep_call: position ids, DoRA's adapters) say
        # which inputs they use; the count check is for rules that take the positional inputs as given
        expected = None if hasattr(rule, "keep_call") else getattr(rule, "num_inputs", 1)
        if expected is not None and len(inputs) != expected and not self.probing and module not in self.verified:
            raise UserError(f"Layer '{self._name(module)}' ({type(module).__name__}) is called with "
                            f"{len(inputs)} inputs but its rule describes {expected}, so its per-example gradient "
                            "is unproven; run the start-up probe (privacy.verify / engine.verify()) or freeze it.")
        output = in_graph(output)  # the layer's weights are excluded from autograd in this pass
        with torch.no_grad():  # what we keep feeds our own arithmetic, never autograd's graph
            rows = output.shape[0] if output.ndim else 0
            detached_kwargs = {k: v for k, v in zip(kwargs, _detached(kwargs.values()))}
            if getattr(rule, "takes_keywords", False):  # the torch.func fallback replays the call as made
                kept = rule.keep(module, (_detached(args), detached_kwargs, self.batch_size))
            elif hasattr(rule, "keep_call"):  # inputs derived from keyword arguments (position_ids, DoRA's adapters)
                kept = rule.keep_call(module, _detached(args), kwargs)
            else:
                kept = rule.keep(module, _detached(inputs))
        if hasattr(rule, "broadcast_output"):  # one output row shared by the batch: one view per example (BART)
            output = rule.broadcast_output(module, output, kept)
            rows = output.shape[0] if output.ndim else 0
        use = self._new_use(module, rule, names, kept, output)
        if self.batch_size is None or rows != self.batch_size:
            use.problem = (f"its output has {rows} rows where the model's batch has {self.batch_size} examples, so "
                           "its rows are not one example each (sequence-first layout, experts fed gathered tokens, "
                           "a batch-shared tensor)")
        else:
            use.units = torch.arange(rows, device=output.device)
        if use.problem is None and not self.probing:
            use.problem = self.batch_problem or subclass_at_call(inputs, output, weights_at_call(module, names))
        if self.probing and module in self._expanded:
            self.expansions[-1] = (module, self.expansions[-1][1], output)
        self._expanded.discard(module)
        return output

    def record(self, module: nn.Module, rule: Any, kept: Any, output: Tensor, grad_view=None) -> Use:
        """One use recorded by a rule with its own hooks, whose ``kept`` rows are already regrouped one per example
        (``grad_view`` regroups the output's gradient the same way): shared tables, flattened or sequence-first
        rows."""
        use = self._new_use(module, rule, self.tracked[module][1], kept, output, grad_view)
        use.units = torch.arange(self.batch_size, device=output.device)
        return use

    def _new_use(self, module: nn.Module, rule: Any, names: tuple, kept: Any, output: Tensor, grad_view=None) -> Use:
        use = Use(module, rule, names, kept, output=output, version=output._version,
                  kept_versions=tuple((x, x._version) for x in tensors_in(kept)))
        if not self.probing:  # (the probe's own hooks and mode are on while it runs)
            use.problem = foreign_code_at_call(module, self.hook_keys[module], self.global_hooks)
        use.selective_checkpoint = selective_checkpoint_at_call()  # the probe's passes too: torch would fail them
        hooked, reshape = gradient_site(output)
        if hooked is output and output._base is not None:
            use.output_ref = weakref.ref(output)  # a hook on a view is bypassed if the view changes in place
        if hooked.grad_fn is not None or hooked.requires_grad:
            use.edge = torch.autograd.graph.get_gradient_edge(hooked)
        self._pending.append(use)
        # The hook lives on the autograd graph, so what its closure holds strongly forms a cycle through C++
        # (node → hook → use → edge → node) that Python's collector cannot see: holding the use or the output
        # kept every step's layer outputs alive for the whole run (+665 MB per step on SmolLM2, T=64, B=8).
        # The recorder's list owns the use until the engine takes it; the hook only looks it up.
        use_ref, shape, recorder_ref = weakref.ref(use), output.shape, weakref.ref(self)

        def keep_grad(grad: Tensor) -> None:
            use = use_ref()
            if use is None or use.released or use.grad_output is not None:
                return
            use.problem = use.problem or use.in_place_problem()
            grad = grad.view(shape) if reshape else grad
            use.grad_output = grad if grad_view is None else grad_view(grad)
            recorder = recorder_ref()
            if recorder is not None and recorder.norm_in_hook is not None:
                recorder.norm_in_hook(use)

        hooked.register_hook(keep_grad)
        self.uses.append(use)
        return use

