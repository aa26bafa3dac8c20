"""The rule registry: which per-example gradient rule applies to a module.

A *rule* knows, for one layer type, how a per-example gradient of each of its parameters follows from
what hooks can see: the activation the layer kept from the forward pass (``activation``) and the
gradient of the loss with respect to the layer's output (``grad_output``), both with the batch first.
Every rule offers the same four functions (there is no base class: each rule file reads on its own):

* ``keep(module, inputs)``: what to keep from the forward pass (the input, the normalised input, the ids);
* ``norm_sq(module, activation, grad_output)``: ``{name: (B,) squared per-example norms}``, fp32;
* ``clipped_sum(module, activation, grad_output, coef)``: ``{name: Σ_i coef[name][i] · G_i}``;
* ``per_example(module, activation, grad_output)``: ``{name: (B, *shape) instantiated G_i}``;
* ``outer_form(module, activation, grad_output)``: ``{name: OuterForm}`` for the parameters whose G_i is a sum
  of outer products over positions (Linear, Conv1D, Embedding); shared parameters need it for their cross terms.

Optional, for layers whose call is not "batch-first input in, batch-first output out":
* ``keep_call(module, args, kwargs)`` instead of ``keep`` when the inputs come as keywords (positions, DoRA);
* ``broadcast_output(module, output, kept)``: an output of one row broadcast over the batch, expanded to it;
* ``install(module, recorder, root) -> handles``: the rule records its uses itself (a bias table shared by the
  batch, rows flattened or sequence-first), through ``recorder.record``;
* ``unsupported(module) -> reason``: refused before step 0 with that reason.
Model patches (``register_model_patch``) rewrite, while the engine records, a computation that several modules
share across the batch so that it meets the batch first (DeBERTa's relative positions); the modules involved
then keep their ordinary rules.
Child rules (``register_child_rule``) are keyed by the parent's class and the attribute name, for plain layers
whose use is special (T5's relative bias is an nn.Embedding, OPT's fc1 an nn.Linear fed flattened rows).

Rules are registered by ``nn.Module`` class (opacus style), or by the class's qualified name for the many
Hugging Face layers that are one formula in many model files (``GemmaTextScaledWordEmbedding``,
``BartScaledWordEmbedding``, ...): matching the exact name keeps the registry from importing dozens of
modeling modules, and a class of another name never matches. A subclass inherits its parent's rule only if it
does not override ``forward``: a changed forward may compute something the rule does not describe. Rules with a
``matches(module)`` function are also tried structurally (any RMSNorm-shaped module), and such a match is
confirmed numerically by the rule's ``verify(module)`` before it is trusted.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

from torch import nn

RULES: dict[type, Any] = {}
NAMED_RULES: dict[str, Any] = {}  # "module.QualifiedName" -> rule, exact class only
CHILD_RULES: dict[tuple[str, str], Any] = {}  # (parent's qualified class name, attribute) -> rule
STRUCTURAL_RULES: list[Any] = []
MODEL_PATCHES: list[Callable] = []  # (root, recorder) -> handles: rewrite a batch-shared path to meet the batch early


def register_rule(*module_classes: type) -> Callable[[type], type]:
    """Class decorator: one instance of the rule serves every module of these classes."""

    def decorate(rule_class: type) -> type:
        rule = rule_class()
        for module_class in module_classes:
            RULES[module_class] = rule
        if hasattr(rule, "matches"):
            STRUCTURAL_RULES.append(rule)
        return rule_class

    return decorate


def register_rule_by_name(*qualified_names: str) -> Callable[[type], type]:
    """Like ``register_rule`` for classes named "package.module.Class" (the exact class; subclasses do not match)."""

    def decorate(rule_class: type) -> type:
        rule = rule_class()
        for name in qualified_names:
            NAMED_RULES[name] = rule
        return rule_class

    return decorate


def register_child_rule(parent_qualified_name: str, attribute: str) -> Callable[[type], type]:
    """A rule for the module stored as ``parent.attribute`` where the parent is of that exact class: a plain layer
    whose use is special (T5's relative-position bias is an nn.Embedding looked up once for the whole batch)."""

    def decorate(rule_class: type) -> type:
        CHILD_RULES[(parent_qualified_name, attribute)] = rule_class()
        return rule_class

    return decorate


def register_model_patch(patch: Callable) -> Callable:
    """``patch(root, recorder) -> handles`` runs when the engine installs its hooks on ``root`` (DeBERTa's relative
    positions: a path shared by the batch that no single module's rule can separate per example)."""
    MODEL_PATCHES.append(patch)
    return patch


def find_child_rules(root: nn.Module) -> dict[nn.Module, Any]:
    """The modules of ``root`` that a child rule claims, with that rule; it takes precedence over their class's."""
    claimed = {}
    for parent in root.modules():
        for (parent_name, attribute), rule in CHILD_RULES.items():
            if qualified_name(type(parent)) == parent_name and isinstance(getattr(parent, attribute, None), nn.Module):
                claimed[getattr(parent, attribute)] = rule
                if hasattr(rule, "install"):  # adapters wrapped around it (peft) see the same rows or shared tensor
                    for inner in getattr(parent, attribute).modules():
                        if inner is not getattr(parent, attribute):
                            claimed[inner] = WRAPPED_REFUSAL
    return claimed


class WrappedLayerRefusal:
    def unsupported(self, module: nn.Module) -> str:
        return ("it sits inside a layer whose rows are not one per example (flattened, sequence-first or shared by "
                "the batch), which the engine regroups only for that layer itself (put the adapters elsewhere)")


WRAPPED_REFUSAL = WrappedLayerRefusal()


def qualified_name(module_class: type) -> str:
    return f"{module_class.__module__}.{module_class.__qualname__}"


def find_rule(module: nn.Module, gathered: Callable | None = None):
    """The rule for ``module``, or None when no rule describes it. ``gathered(module)``: a context in which the
    module holds its whole weights (FSDP2: its unit gathered), for a structural match confirmed by running it."""
    module_class = type(module)
    if module_class in RULES:
        return RULES[module_class]
    if qualified_name(module_class) in NAMED_RULES:
        return NAMED_RULES[qualified_name(module_class)]
    for parent in module_class.__mro__[1:]:
        if parent in RULES and module_class.forward is parent.forward:
            return RULES[parent]
    for rule in STRUCTURAL_RULES:
        if rule.matches(module):
            with gathered(module) if gathered is not None else nullcontext():
                if rule.verify(module):
                    return rule
    return None


class InstancePatch:
    """An attribute set on an instance, and put back by ``remove()`` (the engine's hook handles): rules and model
    patches that replace a method of one layer (DeBERTa's positions, UMT5's relative bias)."""

    def __init__(self, module: nn.Module, name: str, value):
        self.module, self.name, self.value = module, name, value
        self.before = module.__dict__.get(name, InstancePatch)  # an instance attribute someone else set, kept
        module.__dict__[name] = value

    def remove(self) -> None:
        if self.module.__dict__.get(self.name) is not self.value:
            return  # replaced again since: not ours to undo
        if self.before is InstancePatch:
            del self.module.__dict__[self.name]
        else:
            self.module.__dict__[self.name] = self.before
