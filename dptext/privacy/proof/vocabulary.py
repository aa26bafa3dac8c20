"""The probe's second shape on the first rows of the vocabulary (``KEPT_ROWS``), as well as on the blocks that differ.

The second probe shape (B = T) is about layouts that confuse examples with positions; the vocabulary plays no part
in them. Yet at its full size the token embedding and the LM head (tied: one V×d matrix) cost most of that shape on
a mid-size model: every forward reads the head, and every example's brute-force gradient of the tied matrix is a
dense V×d tensor (32k × 2k on TinyLlama's shape: 262 MB, formed, added and read per example). So, for the default
synthetic token batch, the second shape runs with the model's vocabulary matrices cut to their first rows: the
input embedding's and the output head's weight (and the head's bias) are the same ``nn.Parameter`` objects holding a
view of their first ``KEPT_ROWS`` rows, ``num_embeddings`` / ``out_features`` say so, and the batch's ids are drawn
below it. Everything else is the model's own code and parameters; the rules run unchanged on the smaller matrices.
The first shape (B ≠ T) runs on the full vocabulary, as does the second shape's hooked forward of the whole model.
A model whose forward does not run on the cut vocabulary (a V-sized buffer such as BART's ``final_logits_bias``)
fails there and is proven whole (``verify``), as a stack that cannot be cut is.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from torch import nn

KEPT_ROWS = 1024  # rows of the vocabulary the second shape keeps: far more than its 16 ids, a small head to read


@dataclass
class VocabularyCut:
    rows: int
    params: list[nn.Parameter] = field(default_factory=list)  # held as a view of their first ``rows`` rows
    sizes: list[tuple[nn.Module, str]] = field(default_factory=list)  # (module, attribute holding the vocabulary)


def plan_vocabulary_cut(model: nn.Module, vocab: int | None, rows: int | None = None) -> VocabularyCut | None:
    """The model's input embedding and output head of ``vocab`` rows cut to ``rows`` (``KEPT_ROWS``); None when
    there is no such matrix, the vocabulary is not much larger, or a padding row lies beyond the cut."""
    rows = rows or KEPT_ROWS
    if not vocab or vocab < 2 * rows:
        return None
    found: list[tuple[nn.Module, str]] = []
    inputs = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if type(inputs) is nn.Embedding and inputs.num_embeddings == vocab:
        if inputs.padding_idx is not None and inputs.padding_idx >= rows:
            return None
        found.append((inputs, "num_embeddings"))
    outputs = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(outputs) is nn.Linear and outputs.out_features == vocab:
        found.append((outputs, "out_features"))
    if not found:
        return None
    cut = VocabularyCut(rows, sizes=found)
    for module, _ in found:
        for param in module.parameters(recurse=False):
            if param.shape[0] != vocab:
                return None
            if all(param is not other for other in cut.params):  # tied: one matrix, cut once
                cut.params.append(param)
    return cut


@contextmanager
def vocabulary_applied(cut: VocabularyCut | None):
    """The model with its vocabulary matrices cut (the same parameter objects), restored after; gradients formed
    on the cut matrices are dropped, so none of the wrong shape survives."""
    if cut is None:
        yield
        return
    data = [param.data for param in cut.params]
    sizes = [getattr(module, attribute) for module, attribute in cut.sizes]
    try:
        for param, whole in zip(cut.params, data):
            param.data = whole[:cut.rows]
        for module, attribute in cut.sizes:
            setattr(module, attribute, cut.rows)
        yield
    finally:
        for param, whole in zip(cut.params, data):
            param.grad = None
            param.data = whole
        for (module, attribute), size in zip(cut.sizes, sizes):
            setattr(module, attribute, size)
