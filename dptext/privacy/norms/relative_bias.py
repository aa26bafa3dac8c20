"""Relative-position bias tables shared by the whole batch (T5, MPNet): an nn.Embedding of shape (buckets, heads)
looked up once per forward pass with a (q, k) matrix of bucket ids, whose (1, H, q, k) result every example
adds to its attention scores, in every layer.

The table's output has no per-example axis, so the gradient a hook on it sees is already summed over the
batch (and a pre-hook that expanded its ids would change the forward). Each example's own gradient exists one
step later, where the bias meets the batch: the (B, H, q, k) tensor the attention layers add. The rule records
the use there: example i's gradient is G_i = Σ_{q,k} onehot(bucket[q, k]) ⊗ ∂L_i/∂bias[i, :, q, k] (summed over
layers, since every layer adds the same tensor), which is the Embedding rule with ids = buckets repeated for
each example and g = ∂L/∂bias moved to (B, q·k, H). So norms, clipped sums, per-example gradients and ghost
mode all come from the Embedding rule.

* T5: the first self-attention layer of each stack computes the bias (``compute_bias``) when none is passed and
  hands it to the others. A pre-hook computes it first, as a view expanded to the batch (same values), and
  passes it in; the hook on that view gets (B, H, q, k) gradients.
* MPNet: the encoder computes the bias already expanded and copied to (B, H, q, k); the first attention layer
  that receives it registers the hook.
* UMT5: every attention layer has a table of its own and computes its bias itself (``compute_bias``), so that
  method is replaced on each layer by one that expands its result to the batch (a view: same sums) and records
  it. The generic Embedding rule took the (q, k) bucket ids for rows: wrong when B = q, a crash when q = 1.
"""

from __future__ import annotations

from torch import Tensor, nn

from dptext.privacy.proof.in_place import in_graph

from dptext.privacy.norms.embedding import EmbeddingRule
from dptext.privacy.norms.registry import InstancePatch, qualified_name, register_child_rule


def record_shared_lookup(recorder, table: nn.Module, rule, ids: Tensor, bias: Tensor) -> None:
    """Record one use of ``table`` whose per-example output gradient is that of ``bias`` (B, H, q, k)."""
    batch, heads, queries, keys = bias.shape
    activation = ids.detach().reshape(1, queries * keys).expand(batch, -1)
    recorder.record(table, rule, activation, bias,
                    grad_view=lambda grad: grad.permute(0, 2, 3, 1).reshape(batch, queries * keys, heads))


class SharedTableRule(EmbeddingRule):
    """Common part: a forward hook on the table keeps its ids and keeps its output in the graph."""

    def __init__(self):
        self.pending: dict[nn.Module, Tensor] = {}

    def table_hook(self, recorder):
        def after_lookup(table, args, output):
            if recorder.active():
                output = in_graph(output)  # book-keeping took the table out of autograd: keep the path
                self.pending[table] = args[0].detach()
            return output

        return after_lookup


@register_child_rule("transformers.models.t5.modeling_t5.T5Attention", "relative_attention_bias")
class T5RelativeBiasRule(SharedTableRule):
    def install(self, table: nn.Module, recorder, root: nn.Module) -> list:
        handles = [table.register_forward_hook(self.table_hook(recorder))]
        for attention in root.modules():
            if getattr(attention, "relative_attention_bias", None) is table:
                handles.append(attention.register_forward_pre_hook(self._before_attention(table, recorder),
                                                                    with_kwargs=True))
        return handles

    def _before_attention(self, table, recorder):
        def compute_bias_per_example(attention, args, kwargs):
            if not recorder.active() or kwargs.get("position_bias") is not None:
                return None
            hidden = args[0] if args else kwargs["hidden_states"]
            cache = kwargs.get("past_key_values")
            past = int(cache.get_seq_length(attention.layer_idx)) if cache is not None else 0
            length = hidden.shape[1]
            bias = attention.compute_bias(length, past + length, device=hidden.device, past_seen_tokens=past)
            bias = bias.expand(hidden.shape[0], -1, -1, -1)  # a view: the sums the layers compute are unchanged
            record_shared_lookup(recorder, table, self, self.pending.pop(table), bias)
            return args, {**kwargs, "position_bias": bias}

        return compute_bias_per_example


UMT5_ATTENTION = "transformers.models.umt5.modeling_umt5.UMT5Attention"


@register_child_rule(UMT5_ATTENTION, "relative_attention_bias")
class UMT5RelativeBiasRule(SharedTableRule):
    def install(self, table: nn.Module, recorder, root: nn.Module) -> list:
        attention = next(m for m in root.modules() if getattr(m, "relative_attention_bias", None) is table)
        return [table.register_forward_hook(self.table_hook(recorder)),
                InstancePatch(attention, "compute_bias", self._per_example(table, recorder, attention.compute_bias))]

    def _per_example(self, table, recorder, compute_bias):
        def compute_bias_per_example(*args, **kwargs):
            bias = compute_bias(*args, **kwargs)
            if recorder.active() and table in self.pending and recorder.batch_size:
                bias = bias.expand(recorder.batch_size, -1, -1, -1)  # a view: the scores it is added to are the same
                record_shared_lookup(recorder, table, self, self.pending.pop(table), bias)
            return bias

        return compute_bias_per_example


MPNET_ATTENTION = "transformers.models.mpnet.modeling_mpnet.MPNetSelfAttention"


@register_child_rule("transformers.models.mpnet.modeling_mpnet.MPNetEncoder", "relative_attention_bias")
class MPNetRelativeBiasRule(SharedTableRule):
    def install(self, table: nn.Module, recorder, root: nn.Module) -> list:
        handles = [table.register_forward_hook(self.table_hook(recorder))]
        for attention in root.modules():
            if qualified_name(type(attention)) == MPNET_ATTENTION:
                handles.append(attention.register_forward_pre_hook(self._before_attention(table, recorder),
                                                                    with_kwargs=True))
        return handles

    def _before_attention(self, table, recorder):
        def record_first_consumer(attention, args, kwargs):
            bias = args[2] if len(args) > 2 else kwargs.get("position_bias")
            if recorder.active() and bias is not None and table in self.pending:
                record_shared_lookup(recorder, table, self, self.pending.pop(table), bias)
            return None

        return record_first_consumer
