"""Long sequences: which layers book-keeping gives the ghost treatment, chosen by memory at plan time (issue 42).

Book-keeping keeps every tracked layer's input activation and output gradient until each example's whole-model
norm is known. A layer under the *ghost treatment* (``clipping/hybrid.py``) has its norm taken in its gradient hook
and its records dropped there; its clipped sum comes from a second backward pass of Σ_i c_i·loss_i, as in ghost
clipping. The rule, per layer, from shapes the plan knows (docs/privacy_engine.md, "Long sequences"):

    stored bytes per example = T × (input width + output width) × bytes per element  >  max_stored_bytes  →  ghost

It applies only when asked (``max_stored_bytes`` with ``sequence_length``): the docs give the measurement that
says why there is no default threshold. Eligible are layers whose records are one input and one output of known
widths (``nn.Linear``, GPT-2's ``Conv1D``, ``nn.Embedding``) with a plain rule, and whose parameters no other
tracked layer shares (a tied weight's cross term needs both uses' records at once).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dptext.errors import UserError

SPECIAL_RULES = ("install", "keep_call", "takes_keywords", "layout", "broadcast_output")  # records of their own


def record_width(module: nn.Module, rule: Any) -> int | None:
    """Elements book-keeping keeps per token for one call of ``module`` (input + output gradient), or None where
    the records are not one input and one output of known widths."""
    if any(hasattr(rule, name) for name in SPECIAL_RULES):
        return None
    if type(module) is nn.Linear:  # noqa: E721 (subclasses may record more)
        return module.in_features + module.out_features
    if type(module) is nn.Embedding:  # noqa: E721 (the ids are kept too: 8 bytes a token, left out)
        return module.embedding_dim
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:  # HF GPT-2: (in, out)
        return sum(module.weight.shape)
    return None


def stored_bytes(module: nn.Module, rule: Any, names: tuple[str, ...], sequence_length: int) -> int | None:
    """Bytes book-keeping would keep for one example's call of ``module`` at ``sequence_length`` tokens."""
    width = record_width(module, rule)
    if width is None:
        return None
    return sequence_length * width * module.get_parameter(names[0]).element_size()


def ghost_treated(tracked: dict[nn.Module, tuple[Any, tuple[str, ...]]], max_stored_bytes: float | None,
                  sequence_length: int | None) -> dict[nn.Module, int]:
    """The tracked layers that take the ghost treatment, each with its stored bytes per example (empty: plain
    book-keeping)."""
    if max_stored_bytes is None:
        return {}
    owners: dict[int, int] = {}
    for module, (_, names) in tracked.items():
        for name in names:
            owners[id(module.get_parameter(name))] = owners.get(id(module.get_parameter(name)), 0) + 1
    chosen = {}
    for module, (rule, names) in tracked.items():
        if any(owners[id(module.get_parameter(name))] > 1 for name in names):
            continue  # tied: stays book-keeping (its cross term needs both records)
        size = stored_bytes(module, rule, names, sequence_length)
        if size is not None and size > max_stored_bytes:
            chosen[module] = size
    return chosen


def check_settings(max_stored_bytes: float | None, sequence_length: int | None, clipping_mode: str,
                   clipping_layout: str, distributed: Any) -> tuple[float | None, int | None]:
    """The ghost treatment's settings, refused in one sentence before anything is planned; returns them."""
    if max_stored_bytes is None and sequence_length is None:
        return None, None
    if max_stored_bytes is None or sequence_length is None or max_stored_bytes < 0 or sequence_length < 1:
        raise UserError("Give max_stored_bytes (≥ 0) together with sequence_length (≥ 1): the ghost treatment is "
                        "chosen per layer from the bytes its records would hold at that length.")
    if clipping_mode != "bookkeeping" or clipping_layout != "all_layer":
        raise UserError("max_stored_bytes switches layers of book-keeping to the ghost treatment, whose second "
                        "backward pass applies one factor per example; use clipping_mode='bookkeeping' with "
                        "clipping_layout='all_layer', or drop max_stored_bytes.")
    if distributed is not None and getattr(distributed, "sharded", False):
        raise UserError("max_stored_bytes is not supported under FSDP2 yet (the second pass would reduce-scatter "
                        "outside the engine's chunks); drop it when sharding.")
    return float(max_stored_bytes), int(sequence_length)
