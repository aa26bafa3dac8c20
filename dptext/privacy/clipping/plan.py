"""The engine's plan: which modules it tracks, with which rule, and which rules still need the probe.

Every module owning trainable parameters gets a rule or the model is refused before step 0 (SPEC §2: "any
trainable module without a rule must fail before the first step"); the optimizer must update nothing else.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from dptext.errors import UserError
from dptext.privacy.norms import find_child_rules, find_rule
from dptext.privacy.norms.functional import FunctionalRule


def _module_names(model: nn.Module) -> dict[nn.Module, str]:
    return {module: name or type(model).__name__ for name, module in model.named_modules()}


def find_tracked_modules(model: nn.Module, clipping_mode: str, learned: dict[nn.Module, FunctionalRule] | None = None,
                         gathered=None) -> dict[nn.Module, tuple[Any, tuple[str, ...]]]:
    """Every module owning trainable parameters, with its rule; refuses the model before step 0 otherwise.
    ``gathered``: FSDP2, a layer's weights gathered where a rule runs it (``find_rule``).

    A ``FunctionalRule`` learns which inputs carry the batch, so it must not be shared: the registry holds one
    instance per layer class, and what one engine's probe learned would decide another model's calls. Each layer
    gets its own instance from ``learned`` (the engine's, kept across re-plans so the probe's lessons stay)."""
    learned = {} if learned is None else learned
    names = _module_names(model)
    owners: dict[nn.Parameter, list[nn.Module]] = {}
    tracked, ruleless = {}, []
    child_rules = find_child_rules(model)  # e.g. T5's relative-position bias: an nn.Embedding used batch-free
    for module in names:
        own = tuple(name for name, p in module.named_parameters(recurse=False) if p.requires_grad)
        if not own:
            continue
        for name in own:
            owners.setdefault(getattr(module, name), []).append(module)
        rule = child_rules.get(module) or find_rule(module, gathered)
        if isinstance(rule, FunctionalRule):
            rule = learned.setdefault(module, FunctionalRule())
        reason = getattr(rule, "unsupported", lambda m: None)(module) if rule else None
        if reason:
            raise UserError(f"Layer '{names[module]}' ({type(module).__name__}) cannot be trained privately: "
                            f"{reason}; change that setting or freeze the layer (requires_grad_(False)).")
        if rule is None:
            ruleless.append((module, own))
        else:
            tracked[module] = (rule, own)
    for module, own in ruleless:
        # HF ties e.g. ``lm_head.bias`` to ``lm_head.decoder.bias``: an alias held by a parent whose child has a rule.
        if all(any(o in tracked and o is not module and names[o].startswith(names[module] + ".")
                   for o in owners[getattr(module, name)]) for name in own):
            continue
        if clipping_mode == "per_sample":
            caller, prefix = _calling_module(model, names, module)
            rule, known = tracked.get(caller) or (learned.setdefault(caller, FunctionalRule()), ())
            if isinstance(rule, FunctionalRule):
                tracked[caller] = (rule, known + tuple(prefix + name for name in own))
                continue
        raise UserError(
            f"Layer '{names[module]}' ({type(module).__name__}) has trainable parameters "
            f"({', '.join(own)}) but no per-example gradient rule; freeze it (requires_grad_(False)), or use "
            "clipping_mode='per_sample', which handles it with torch.func if its forward is a plain function "
            "of its inputs.")
    return tracked


def _calling_module(model: nn.Module, names: dict[nn.Module, str], module: nn.Module) -> tuple[nn.Module, str]:
    """The module whose call uses ``module``'s parameters, and their prefix there. A ParameterDict/List (peft's
    LoRA adapters on embeddings: ``lora_embedding_A['default']``) is never called itself: its parent is."""
    if not isinstance(module, (nn.ParameterDict, nn.ParameterList)) or "." not in names[module]:
        return module, ""
    parent_name, own_name = names[module].rsplit(".", 1)
    return model.get_submodule(parent_name), own_name + "."


def unproven_rules(model: nn.Module, tracked: dict[nn.Module, Any]) -> dict[nn.Module, str]:
    """Tracked modules whose rule holds only if the start-up probe confirms it on that module (issue 23 point 3).

    The registry already refuses subclasses that override ``forward`` and confirms structural matches
    numerically; what it cannot see is an instance whose ``forward`` was replaced and foreign forward hooks
    (a pre-hook rewrites the input, a hook registered with prepend=True rewrites the output before ours). Hooks are
    found through ``Module._forward_hooks`` and friends: torch has no public way to list them."""
    global_hooks = bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)
    unproven = {}
    for module, (rule, _) in tracked.items():
        if "forward" in vars(module):
            unproven[module] = "its forward is replaced on the instance"
        elif module._forward_hooks or module._forward_pre_hooks or global_hooks:
            unproven[module] = "other forward hooks can rewrite its inputs or outputs"
    return unproven


def global_hook_keys() -> tuple:
    """The handle ids of torch's global module hooks (``register_module_forward_hook`` and friends), which run on
    every module's call like hooks of its own."""
    return tuple(tuple(store) for store in (torch_module._global_forward_hooks,
                                           torch_module._global_forward_pre_hooks,
                                           torch_module._global_backward_hooks,
                                           torch_module._global_backward_pre_hooks))


def _check_optimizer(optimizer: torch.optim.Optimizer, params: list[nn.Parameter],
                     names: dict[nn.Parameter, str] | None = None) -> None:
    private = set(params)
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.requires_grad and param not in private:
                what = f"'{names[param]}'" if names and param in names else f"of shape {tuple(param.shape)}"
                raise UserError(f"The optimizer updates a parameter {what} that is not a trainable parameter of "
                                "the model given to the engine, so it would not be privatized; pass the model "
                                "that owns it or remove it from the optimizer.")


def _check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserError(f"{what} must be one of {', '.join(choices)}, not '{value}'.")


def _sampling_numbers(sample_rate, dataset_size, expected_batch_size) -> tuple[float, int | None, float]:
    if expected_batch_size is None:
        if sample_rate is None or dataset_size is None:
            raise UserError("Give sample_rate and dataset_size (or expected_batch_size): the noisy sum is divided "
                            "by the expected batch size B = q·n.")
        expected_batch_size = sample_rate * dataset_size
    elif sample_rate is None:
        if dataset_size is None:
            raise UserError("Give dataset_size with expected_batch_size so the sampling rate q = B/n is known.")
        sample_rate = expected_batch_size / dataset_size
    if not 0 < sample_rate <= 1 or expected_batch_size <= 0 or not math.isfinite(expected_batch_size):
        raise UserError(f"The sampling rate must be in (0, 1] and the expected batch size positive "
                        f"(got q={sample_rate}, B={expected_batch_size}).")
    return float(sample_rate), dataset_size, float(expected_batch_size)
