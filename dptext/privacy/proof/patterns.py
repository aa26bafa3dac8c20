"""Use patterns: which tracked layers share a verdict of the start-up probe's numeric comparison.

A rule's per-example norms and clipped sums depend on the layer's class, its parameters (names, shapes, which are
trained), the rule, and the code that calls it — the forward of every module above it, and any hook or
instance-level ``forward`` on the way. Two layers equal in all of these run the same code on tensors of the same
shapes, so the numeric comparison of the first one (the *representative*) with brute-force per-example autograd
decides for both. The key below is that list, plus the layer's dotted name with every index of a repeated block
(``layers.3``) replaced by ``*``, so the first and the fourth decoder layer's ``q_proj`` share a pattern while a
decoder's and an encoder's do not.

A layer is always its own representative when the key cannot describe what makes it special:
* a parameter shared with another tracked layer (tied embeddings: the cross term is per pair);
* its rule learns from the probe (the ``torch.func`` fallback learns, per layer, which inputs carry the batch);
* it, or any module above it, has a forward replaced on the instance or a foreign hook (forward, backward,
  pre-hooks): such code is per instance, not per class.
The key also holds each module's plain instance settings up the chain (``instance_settings``): a forward may branch
on them, so Gemma's sliding-window and global layers are two patterns, and a block with ``self.mix = True`` is not
the pattern-mate of one without. The block index (``layer_idx``) is left out: transformers use it to index caches
and per-layer config lists, and keeping it would make every block its own pattern.
The same argument, lifted from a layer to its block, lets the probe run its numeric part on each block stack cut
after its last block that differs (``proof.stack``); the whole model keeps one hooked forward per shape (in-place
changes, expansions, parameters read outside their module, buffers) and its examples' loss independence.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn
from torch.nn.modules import module as module_globals

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")
HOOK_STORES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
GLOBAL_HOOK_STORES = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                      "_global_backward_pre_hooks")


def pattern_name(name: str) -> str:
    """``model.layers.3.self_attn.q_proj`` → ``model.layers.*.self_attn.q_proj``."""
    return _INDEX.sub("*", name)


def _instance_code(module: nn.Module, own_hooks: set[int]) -> bool:
    """True if this instance runs code its class does not: a replaced forward or a hook not the engine's nor
    FSDP2's (hooks are keyed by their handle's id in these dicts; torch has no public way to list them), or a
    global module hook, which runs on every module's call and may act on one of them only (a session-25 red team
    hid a second use of one layer's weight behind its pattern-mate that way)."""
    if "forward" in vars(module) or any(getattr(module_globals, store) for store in GLOBAL_HOOK_STORES):
        return True
    return any(key not in own_hooks and not _fsdp_pass_hook(hook)
               for store in HOOK_STORES for key, hook in getattr(module, store).items())


def _fsdp_pass_hook(hook: Any) -> bool:
    """FSDP2's own forward hooks on every unit it wraps (``FSDPState._pre_forward``/``_post_forward``: gather the
    unit's weights, free them), the same code on every unit: they see no example, so they do not make a block
    its own pattern (otherwise every layer of a sharded model would be compared, the whole model's reference).
    Recognised by the function itself, not by what it is bound to (a foreign function bound to FSDP2's state
    object is foreign code: found by the session-25 red team)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:  # another torch: every such hook counts as foreign (each block compared: safe, dearer)
        return False
    return isinstance(getattr(hook, "__self__", None), FSDPState) and \
        getattr(hook, "__func__", None) in (FSDPState._pre_forward, FSDPState._post_forward)


PLAIN = (bool, int, float, str, type(None))
# The one per-instance setting that differs between the blocks of every transformer and that its code uses to
# index shared tables (caches, layer types in the config), not to choose how examples meet.
INDEX_NAMES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx", "idx"})


SMALL_BUFFER = 1 << 16  # buffers up to this many entries are compared by value, larger ones by shape and dtype


def instance_settings(module: nn.Module) -> tuple:
    """The plain settings stored on the instance (``self.sliding_window = 4096``, ``self.mix = True``, lists and
    tuples of such values) and its own buffers (by value when small): a forward may branch on them, so layers
    whose settings differ are different patterns (Gemma's sliding and global layers). Modules and objects such as
    the config are not compared; the block index is left out (docs/privacy_engine.md says what that leaves)."""
    settings: list[tuple] = []
    for name, value in vars(module).items():
        if name.startswith("_") or name in INDEX_NAMES:
            continue
        if isinstance(value, PLAIN) or (isinstance(value, (tuple, list)) and all(isinstance(v, PLAIN) for v in value)):
            settings.append((name, tuple(value) if isinstance(value, list) else value))
    for name, buffer in module._buffers.items():
        if buffer is None:
            continue
        content = tuple(buffer.detach().reshape(-1).tolist()) if buffer.numel() <= SMALL_BUFFER else None
        settings.append((name, tuple(buffer.shape), str(buffer.dtype), content))
    return tuple(sorted(settings, key=lambda item: item[0]))


def representatives(model: nn.Module, tracked: dict[nn.Module, tuple[Any, tuple[str, ...]]],
                    names: dict[nn.Module, str], own_hooks: set[int] = frozenset()) -> dict[nn.Module, nn.Module]:
    """Each tracked module → the tracked module whose numeric comparison decides for it (itself for the first
    of a pattern and for the special cases of the module docstring). ``own_hooks``: the handle ids of the
    engine's own hooks."""
    parents: dict[nn.Module, nn.Module] = {}
    for parent in model.modules():
        for child in parent.children():
            parents.setdefault(child, parent)
    owners: dict[int, int] = {}
    for module, (_, params) in tracked.items():
        for param in params:
            key = id(module.get_parameter(param))
            owners[key] = owners.get(key, 0) + 1
    chosen: dict[tuple, nn.Module] = {}
    decided_by: dict[nn.Module, nn.Module] = {}
    for module, (rule, params) in tracked.items():
        special = any(owners[id(module.get_parameter(p))] > 1 for p in params) or hasattr(rule, "layout")
        chain, above = [], module
        while above is not None:
            special = special or _instance_code(above, own_hooks)
            chain.append((type(above), instance_settings(above)))
            above = parents.get(above)
        if special:
            decided_by[module] = module
            continue
        key = (pattern_name(names.get(module, "")), tuple(chain), type(rule),
               tuple((p, tuple(module.get_parameter(p).shape), module.get_parameter(p).dtype) for p in params),
               tuple((n, tuple(p.shape), p.requires_grad) for n, p in module.named_parameters(recurse=False)))
        decided_by[module] = chosen.setdefault(key, module)
    return decided_by
