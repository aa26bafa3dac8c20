"""The probe's second shape on the first rows of the vocabulary, as well as on the blocks that differ.

The second probe shape (B = T) is about layouts that confuse examples with positions; the vocabulary plays no part
in them. Yet at its full size the token embedding and the LM head (tied: one V×d matrix) cost most of that shape on
a mid-size model: every forward reads the head, and every compared example's brute-force gradient of the tied
matrix is a dense V×d tensor (32k × 2k on TinyLlama's shape: 262 MB, formed, added and read per example). So the
second shape runs with the model's vocabulary matrices cut to their first rows: the input embedding's and the
output head's weight (and the head's bias) are the same ``nn.Parameter`` objects holding a view of their first rows,
every module holding them (``num_embeddings`` / ``out_features``) and the model's config (``vocab_size``) say so,
and the batch is drawn under the cut (the default batch and the tasks' read the vocabulary size when they draw).
The rows kept are at least twice the matrices' width, so that choices made by size (which factor of the LM head's
clipped sum to scale, V > d; the ghost or instantiated norm) come out as on the whole vocabulary.

Everything else is the model's own code and parameters; the rules run unchanged on the smaller matrices. The
first shape (B ≠ T) runs on the full vocabulary, as does the second shape's hooked forward of the whole model. A
batch with an id at or beyond the cut (a task's fixed special token) runs that shape on the whole vocabulary, and
a model whose forward or reference fails on the cut (a V-sized buffer such as BART's ``final_logits_bias``) is
proven whole (``verify``), as a stack that cannot be cut is.

Under FSDP2 (``sharded_cut``) the layers compute with the unsharded parameters FSDP2 registers at each pass
(``proof.sharded_probe``), so those are cut, never the shards: FSDP2 still gathers whole rows into them, and the
layers see their first rows. The engine's clipped sums of the cut matrices then have the cut's rows, reduced into
the shards' layout with zeros beyond (``sharding.row_reduce``), and each rank compares its rows with the
reference's, whose rows beyond the cut are zero (``probe_checks.sum_error``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

KEPT_ROWS = 1024  # the fewest rows of the vocabulary the second shape keeps (at least twice the model's width)


@dataclass
class VocabularyCut:
    rows: int
    params: list[nn.Parameter] = field(default_factory=list)  # held as a view of their first ``rows`` rows
    sizes: list[tuple[Any, str]] = field(default_factory=list)  # (module or config, attribute holding the size)
    shards: list[nn.Parameter] = field(default_factory=list)  # FSDP2: the shards of ``params`` (same order)
    view: Any = None  # FSDP2: the probe's ``ShardedView``, told the cut while it is applied (``cut_rows``)


def sharded_cut(cut: VocabularyCut | None, engine) -> VocabularyCut | None:
    """``cut`` (planned on the shards, which FSDP2 registers between passes) on the unsharded parameters FSDP2
    registers during a pass; None where the engine does not reduce the cut matrices' sums itself (ghost's, and
    the hybrid's ghost-treated layers', are FSDP2's reduce-scatter of whole-shape gradients) or a shard has no
    unsharded parameter known to the probe."""
    view = getattr(engine, "probe_view", None)
    if cut is None or view is None:
        return cut
    holders = [holder for holder, _ in cut.sizes if isinstance(holder, nn.Module)]
    if engine.clipping_mode != "bookkeeping" or any(module in engine.ghost_modules for module in holders) \
            or any(shard not in view.gathered for shard in cut.params):
        return None
    return VocabularyCut(cut.rows, [view.gathered[shard] for shard in cut.params], cut.sizes, list(cut.params),
                         view)


def _matrix_width(module: nn.Module, vocab: int) -> int | None:
    """The width of ``module`` if it is a vocabulary matrix of ``vocab`` rows (an embedding or an output head)."""
    if isinstance(module, nn.Embedding) and module.num_embeddings == vocab:
        return module.embedding_dim
    if isinstance(module, nn.Linear) and module.out_features == vocab:
        return module.in_features
    return None


def _matrix(model: nn.Module, getter: str) -> nn.Module | None:
    """``model.get_input_embeddings()`` or ``get_output_embeddings()``; None where the model has none (transformers'
    default raises NotImplementedError on models without token embeddings: Wav2Vec2, DecisionTransformer)."""
    try:
        return getattr(model, getter)() if hasattr(model, getter) else None
    except (NotImplementedError, AttributeError):
        return None


def token_vocabulary(model: nn.Module) -> int | None:
    """The model's vocabulary size (its config's, else its input embedding's), or None."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size or getattr(_matrix(model, "get_input_embeddings") or model, "num_embeddings", None)


def plan_vocabulary_cut(model: nn.Module, vocab: int | None, rows: int | None = None) -> VocabularyCut | None:
    """The model's input embedding and output head of ``vocab`` rows cut to ``rows`` (``KEPT_ROWS``, at least
    twice their width); None when there is no such matrix, the vocabulary is not much larger, a padding row lies
    beyond the cut, or a module other than an embedding or a linear layer holds one of the cut parameters."""
    if not vocab:
        return None
    found = {module: _matrix_width(module, vocab) for module in (_matrix(model, "get_input_embeddings"),
                                                                _matrix(model, "get_output_embeddings"))}
    matrices = [module for module, width in found.items() if width is not None]
    if not matrices:
        return None
    rows = max(rows or KEPT_ROWS, 2 * max(found[module] for module in matrices))
    if vocab < 2 * rows:
        return None
    cut = VocabularyCut(rows)
    for module in matrices:
        for param in module.parameters(recurse=False):
            if param.shape[0] != vocab:
                return None
            if all(param is not other for other in cut.params):  # tied: one matrix, cut once
                cut.params.append(param)
    for module in model.modules():  # every module holding a cut matrix (a tied head, a scaled embedding)
        if not any(param is held for param in cut.params for held in module.parameters(recurse=False)):
            continue
        if _matrix_width(module, vocab) is None:
            return None
        if isinstance(module, nn.Embedding):
            if module.padding_idx is not None and module.padding_idx >= rows:
                return None
            cut.sizes.append((module, "num_embeddings"))
        else:
            cut.sizes.append((module, "out_features"))
    config = getattr(model, "config", None)
    if getattr(config, "vocab_size", None) == vocab:
        cut.sizes.append((config, "vocab_size"))
    return cut


def ids_below(batch: dict[str, Any], rows: int) -> bool:
    """Whether every integer tensor of ``batch`` (ids, labels) stays below ``rows``: an id beyond the cut must
    never reach the cut embedding (on a GPU an out-of-range lookup is a device-side assert, not an exception)."""
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.numel() and not value.is_floating_point() \
                and value.dtype != torch.bool and int(value.max()) >= rows:
            return False
    return True


@contextmanager
def vocabulary_applied(cut: VocabularyCut | None):
    """The model with its vocabulary matrices cut (the same parameter objects), restored after. The cut matrices
    hold no gradient inside (one of the whole shape would not fit) and none after (one formed on the cut matrix has
    the wrong shape); ``kept_gradients`` gives the user's own back once the probe is done."""
    if cut is None:
        yield
        return
    data = [param.data for param in cut.params]
    sizes = [getattr(holder, attribute) for holder, attribute in cut.sizes]
    try:
        for param, whole in zip(cut.params, data):
            param.grad = None
            param.data = first_rows(whole, cut.rows)
        for holder, attribute in cut.sizes:
            setattr(holder, attribute, cut.rows)
        if cut.view is not None:
            cut.view.cut_rows = dict.fromkeys(cut.shards, cut.rows)
        yield
    finally:  # nothing here can fail, so the model never stays cut
        if cut.view is not None:
            cut.view.cut_rows = {}
        for (holder, attribute), size in zip(cut.sizes, sizes):
            setattr(holder, attribute, size)
        for param, whole in zip(cut.params, data):
            param.grad = None
            param.data = whole


def first_rows(whole: torch.Tensor, rows: int) -> torch.Tensor:
    """``whole``'s first ``rows`` rows, on its storage (a slice's layout) but made without a bounds check: FSDP2
    frees a unit's gathered storage between its passes (resized to 0, refilled in place by the next gather), where
    a slice is refused as out of bounds (a unit holding only the embedding or the head, resharded after its
    forward: the probe crashed with torch's raw error)."""
    return torch.empty(0, dtype=whole.dtype, device=whole.device).set_(
        whole.untyped_storage(), whole.storage_offset(), (rows, *whole.shape[1:]), whole.stride())


@contextmanager
def kept_gradients(cut: VocabularyCut | None):
    """The gradients the cut matrices held before the probe, given back after it (outside the probe's change of
    precision, so that they fit the parameters again)."""
    grads = [(param, param.grad) for param in cut.params] if cut else []
    try:
        yield
    finally:
        for param, grad in grads:
            if grad is not None and param.grad is None and grad.shape == param.shape and grad.dtype == param.dtype:
                param.grad = grad
