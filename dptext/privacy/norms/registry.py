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

Rules are registered by ``nn.Module`` class (opacus style). A subclass inherits its parent's rule only if it
does not override ``forward``: a changed forward may compute something the rule does not describe. Rules with a
``matches(module)`` function are also tried structurally (any RMSNorm-shaped module), and such a match is
confirmed numerically by the rule's ``verify(module)`` before it is trusted.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

RULES: dict[type, Any] = {}
STRUCTURAL_RULES: list[Any] = []


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


def find_rule(module: nn.Module):
    """The rule for ``module``, or None when no rule describes it."""
    module_class = type(module)
    if module_class in RULES:
        return RULES[module_class]
    for parent in module_class.__mro__[1:]:
        if parent in RULES and module_class.forward is parent.forward:
            return RULES[parent]
    for rule in STRUCTURAL_RULES:
        if rule.matches(module) and rule.verify(module):
            return rule
    return None
