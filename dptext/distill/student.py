"""Students: a hub/local model, or a smaller model made from a bigger one by keeping some layers.

``layer_subset(model, layers)`` builds the same architecture with ``len(layers)`` decoder
layers and copies everything else unchanged — token (and position) embeddings, the final
norm, the LM head — and student layer j from source layer ``layers[j]``. Tied input/output
embeddings stay tied (one tensor). Supported: GPT-2 style (``transformer.h``) and
Llama/SmolLM2 style (``model.layers``) causal LMs.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Sequence

import torch

from dptext.errors import UserError
from dptext.models import load_model
from dptext.runs import atomic_directory

# (attribute path of the decoder layer list, config field holding the layer count)
LAYER_LISTS = (("transformer.h", "n_layer"), ("model.layers", "num_hidden_layers"))


def _layer_list(model: Any) -> tuple[str, str]:
    for path, count_field in LAYER_LISTS:
        node = model
        try:
            for part in path.split("."):
                node = getattr(node, part)
        except AttributeError:
            continue
        return path, count_field
    raise UserError(f"Cannot take a layer subset of a {type(model).__name__}: only GPT-2 and Llama-style causal LMs "
                    "are supported; use a hub student (distill.student) instead.")


def layer_indices(total: int, layers: Sequence[int] = (), stride: int | None = None) -> list[int]:
    """Explicit ``layers``, or every ``stride``-th layer counted from the top (the last layer is kept)."""
    if layers:
        chosen = [int(i) for i in layers]
    elif stride:
        chosen = list(range(total - 1, -1, -stride))[::-1]
    else:
        return list(range(total))
    if sorted(set(chosen)) != chosen or chosen[0] < 0 or chosen[-1] >= total:
        raise UserError(f"Student layers {chosen} must be increasing, distinct and within 0..{total - 1}.")
    return chosen


def layer_subset(model: Any, layers: Sequence[int]) -> Any:
    """A new model with decoder layers ``layers`` of ``model`` (weights copied, ties kept)."""
    path, count_field = _layer_list(model)
    config = copy.deepcopy(model.config)
    setattr(config, count_field, len(layers))
    if getattr(config, "layer_types", None) is not None:  # per-layer attention types follow their layers
        config.layer_types = [config.layer_types[i] for i in layers]
    with torch.random.fork_rng(devices=[]):
        student = type(model)(config)
    source = model.state_dict()
    prefix = path + "."
    mapping = {new: old for new, old in enumerate(layers)}
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)\.(.*)$")
    state = {}
    for key in student.state_dict():
        match = pattern.match(key)
        state[key] = source[f"{prefix}{mapping[int(match.group(1))]}.{match.group(2)}" if match else key]
    student.load_state_dict(state)
    if getattr(config, "tie_word_embeddings", False):
        student.tie_weights()
        if student.get_output_embeddings().weight is not student.get_input_embeddings().weight:
            raise UserError("The layer-subset student lost its tied embeddings; report this as a bug.")
    return student.eval()


def build_student(name: str, layers: Sequence[int] = (), stride: int | None = None,
                  target: str | Path | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, description) of the student; saved to ``target`` when given (a local model folder)."""
    model, tokenizer = load_model(name, head="causal_lm")
    total = getattr(model.config, "num_hidden_layers", None) or getattr(model.config, "n_layer")
    chosen = layer_indices(total, layers, stride)
    if chosen != list(range(total)):
        model = layer_subset(model, chosen)
    description = {"source": name, "layers": chosen, "source_layers": total,
                   "parameters": sum(p.numel() for p in model.parameters())}
    if target is not None:
        with atomic_directory(target) as staging:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
    return model, tokenizer, description
