"""DeBERTa-v2/v3 relative-position embeddings: per-example gradients through a table shared by the batch.

The encoder reads its relative-position table as a weight (``rel_embeddings.weight``, never calling the
Embedding), layer-norms it, and every attention layer projects it (``pos_key_proj``/``pos_query_proj``, or its
own ``key_proj``/``query_proj`` when ``share_att_key``) with a batch-1 input, then ``repeat``s the result over
the batch. Each example's gradient flows through that shared chain and autograd sums them at the ``repeat``, so
no hook on the chain sees one example's gradient (the engine refused the projections: a float input shared by
the batch).

While the engine records, the chain is instead computed once per example, so that it meets the batch at its
start, as the T5 rule does at the bias (relative_bias.py):
* the encoder's ``get_rel_embedding`` looks the table up by calling the Embedding with ids 0..R−1 for every
  example ((B, R, d), the same values) and applies its LayerNorm to that: both are recorded by their own rules,
  one row per example;
* each attention layer's ``pos_dropout`` draws one mask for the batch (the model's own: the same random draws as
  on the (R, d) table) and applies it to every example's copy;
* each attention layer's ``disentangled_attention_bias`` calls the projections it uses on the (B, 2s, d) copies
  (recorded per example by the Linear rule, LoRA adapters included; with ``share_att_key`` a second use of the
  content projections, whose cross terms the engine adds), then runs the model's own function once per example
  under ``torch.func.vmap`` with those projections standing in for the modules (each example's batch of one makes
  its ``repeat`` a no-op).
So every parameter of the chain gets its per-example gradient from an existing rule; nothing is copied from the
model's code. The cost is the chain's projections B times instead of once. The patches are installed only when
a parameter of the chain is trainable, and undone with the engine's hooks; when nothing is recorded (evaluation,
the engine's own reference passes) the model's own functions run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dptext.privacy.norms.registry import InstancePatch as _Patch, qualified_name, register_model_patch

ENCODER = "transformers.models.deberta_v2.modeling_deberta_v2.DebertaV2Encoder"
ATTENTION = "transformers.models.deberta_v2.modeling_deberta_v2.DisentangledSelfAttention"


def position_projections(attention: nn.Module) -> list[str]:
    """The projections the attention layer applies to the relative-position embeddings (from its config)."""
    if attention.share_att_key:
        return ["query_proj", "key_proj"]
    kinds = attention.pos_att_type
    return [name for name, kind in (("pos_key_proj", "c2p"), ("pos_query_proj", "p2c")) if kind in kinds]


class _Given(nn.Module):
    """Stands in for a projection inside the per-example function: returns that example's projected rows."""

    def __init__(self, rows: Tensor):
        super().__init__()
        self.rows = rows

    def forward(self, ignored: Tensor) -> Tensor:
        return self.rows


@register_model_patch
def patch_relative_positions(root: nn.Module, recorder) -> list:
    encoders = [m for m in root.modules() if qualified_name(type(m)) == ENCODER and m.relative_attention]
    attentions = [m for m in root.modules() if qualified_name(type(m)) == ATTENTION and m.relative_attention]
    chain = [m for e in encoders for m in (e.rel_embeddings, getattr(e, "LayerNorm", None)) if m is not None]
    chain += [getattr(a, name) for a in attentions for name in position_projections(a)]
    if not any(p.requires_grad for m in chain for p in m.parameters()):
        return []  # nothing of the shared chain is trained: the model's own path is exact (and cheaper)
    handles = [_Patch(e, "get_rel_embedding", _per_example_table(e, recorder)) for e in encoders]
    for attention in attentions:
        handles.append(_Patch(attention.pos_dropout, "forward", _shared_mask(attention.pos_dropout)))
        handles.append(_Patch(attention, "disentangled_attention_bias", _per_example_bias(attention, recorder)))
    return handles


def _per_example_table(encoder: nn.Module, recorder):
    own = type(encoder).get_rel_embedding.__get__(encoder)

    def get_rel_embedding():
        if not recorder.active() or not recorder.batch_size:
            return own()
        table = encoder.rel_embeddings
        ids = torch.arange(table.num_embeddings, device=table.weight.device).expand(recorder.batch_size, -1)
        rows = table(ids)
        return encoder.LayerNorm(rows) if "layer_norm" in encoder.norm_rel_ebd else rows

    return get_rel_embedding


def _shared_mask(dropout: nn.Dropout):
    own = type(dropout).forward.__get__(dropout)

    def forward(rows: Tensor) -> Tensor:
        if rows.dim() != 3 or not dropout.training or dropout.p == 0:
            return own(rows)
        # one mask for the whole batch, from the same draws the model makes on its (R, d) table
        return rows * F.dropout(torch.ones_like(rows[0]), dropout.p, True)

    return forward


def _per_example_bias(attention: nn.Module, recorder):
    own = type(attention).disentangled_attention_bias.__get__(attention)

    def disentangled_attention_bias(query_layer, key_layer, relative_pos, rel_embeddings, scale_factor):
        if rel_embeddings is None or rel_embeddings.dim() == 2:
            return own(query_layer, key_layer, relative_pos, rel_embeddings, scale_factor)
        batch, heads = rel_embeddings.shape[0], attention.num_attention_heads
        names = position_projections(attention)
        used = rel_embeddings[:, :2 * attention.pos_ebd_size]
        projected = [getattr(attention, name)(used) for name in names]  # (B, 2s, p): recorded per example

        def one_example(query, key, *rows):
            saved = {name: attention._modules[name] for name in names}
            try:
                for name, row in zip(names, rows):
                    attention._modules[name] = _Given(row.unsqueeze(0))
                return own(query, key, relative_pos, rel_embeddings[0], scale_factor)
            finally:
                attention._modules.update(saved)

        by_example = [x.reshape(batch, heads, *x.shape[1:]) for x in (query_layer, key_layer)]
        scores = torch.func.vmap(one_example)(*by_example, *projected)
        return scores.reshape(batch * heads, *scores.shape[2:])

    return disentangled_attention_bias
