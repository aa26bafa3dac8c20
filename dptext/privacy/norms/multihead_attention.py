"""torch's ``nn.MultiheadAttention``: exact, by running its forward as an equivalent computation whose two
projections the engine records.

Its own forward hands the raw weights to ``F.multi_head_attention_forward``, which projects q, k, v with
``in_proj_weight`` and the result with ``out_proj.weight`` as plain tensors: no hook sees the projections' inputs
or outputs, and ``out_proj`` is never called as a module. While the engine records, the module's forward is
therefore replaced (on the instance, removed with the engine's hooks) by the same computation in three steps:

1. **In-projection, one Linear over stacked inputs.** The distinct tensors among query, key and value (one for
   self-attention, two when key is value) are put batch-first and concatenated along positions, and the whole
   (3E × E) ``in_proj_weight`` and bias are applied to every position; q, k and v are the blocks of rows each of
   them uses (q = first E outputs at the query's positions, ...). The gradient of this product is zero outside
   those blocks, so example i's gradient G_i = Σ_t g_t a_tᵀ is exactly the stacked [G_q; G_k; G_v] and the
   Linear rule gives its norm, clipped sum and outer form (norm² = the sum over the blocks used).
2. **Attention** by ``F.multi_head_attention_forward`` itself, on the projected q, k, v with identity projection
   matrices and no biases (x·I = x exactly: every product is by 0 or 1), so masks, ``is_causal``, dropout,
   ``add_zero_attn`` and frozen ``bias_k``/``bias_v`` behave exactly as in the module's own forward.
3. **Out-projection** by calling ``out_proj`` as the Linear it is, on batch-first rows.

The batch is the model's (from its inputs) and the layout comes from ``batch_first``, never from a shape, so
B = T cannot be mistaken for it. Refused: trainable ``bias_k``/``bias_v`` (one row shared by the batch) and
separate q/k/v weights (``kdim``/``vdim`` ≠ ``embed_dim``) that are trainable. When nothing is recorded
(evaluation, ``torch.no_grad``, the engine's own reference passes) the module's own forward runs unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dptext.errors import UserError
from dptext.privacy.norms.linear import LinearRule
from dptext.privacy.norms.registry import qualified_name, register_child_rule, register_rule

PATCHED = "_dptext_recorded_forward"  # marks our forward on the instance


class InProjectionRule:
    """``in_proj_weight``/``in_proj_bias`` as the weight and bias of one Linear over the stacked inputs."""

    inner = LinearRule()
    as_linear = {"in_proj_weight": "weight", "in_proj_bias": "bias"}

    def _call(self, method: str, module, names, *args):
        back = {linear: own for own, linear in self.as_linear.items() if own in names}
        result = getattr(self.inner, method)(module, tuple(back), *args)
        return {back[name]: value for name, value in result.items() if name in back}

    def norm_sq(self, module, names, activation, grad_output):
        return self._call("norm_sq", module, names, activation, grad_output)

    def clipped_sum(self, module, names, activation, grad_output, coef):
        coef = {self.as_linear[name]: value for name, value in coef.items()}
        return self._call("clipped_sum", module, names, activation, grad_output, coef)

    def per_example(self, module, names, activation, grad_output):
        return self._call("per_example", module, names, activation, grad_output)

    def outer_form(self, module, names, activation, grad_output):
        return self._call("outer_form", module, names, activation, grad_output)



@register_rule(nn.MultiheadAttention)
class MultiheadAttentionRule(InProjectionRule):
    """The module's own parameters: its recorded use is the in-projection (see the module docstring)."""

    def unsupported(self, module: nn.MultiheadAttention) -> str | None:
        if any(p is not None and p.requires_grad for p in (module.bias_k, module.bias_v)):
            return ("its trainable bias_k/bias_v add one key/value row shared by the whole batch, whose "
                    "per-example gradients torch's attention function does not expose")
        separate = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight, module.in_proj_bias)
        if not module._qkv_same_embed_dim and any(p is not None and p.requires_grad for p in separate):
            return ("its kdim/vdim differ from embed_dim (separate q/k/v projection weights), which has no rule "
                    "yet (its out_proj alone can be trained)")
        return None

    def install(self, module: nn.Module, recorder, root: nn.Module) -> list:
        return replace_forward(module, recorder)


@register_child_rule(qualified_name(nn.MultiheadAttention), "out_proj")
class MultiheadAttentionOutRule(LinearRule):
    """``out_proj`` is a Linear; the attention module's replaced forward calls it and records the call."""

    def install(self, module: nn.Module, recorder, root: nn.Module) -> list:
        parent = next(m for m in root.modules() if isinstance(m, nn.MultiheadAttention) and m.out_proj is module)
        return replace_forward(parent, recorder)


class _RestoreForward:
    def __init__(self, module: nn.Module, forward):
        self.module, self.forward = module, forward

    def remove(self) -> None:
        if vars(self.module).get("forward") is self.forward:
            del self.module.forward


def replace_forward(attention: nn.MultiheadAttention, recorder) -> list:
    """Install the recorded forward on ``attention`` once (its rule and its out_proj's may both ask)."""
    if getattr(vars(attention).get("forward"), PATCHED, False):
        return []
    own_forward = type(attention).forward.__get__(attention)

    def forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if not recorder.active():
            return own_forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                               average_attn_weights, is_causal)
        return recorded_attention(attention, recorder, (query, key, value), key_padding_mask=key_padding_mask,
                                  need_weights=need_weights, attn_mask=attn_mask,
                                  average_attn_weights=average_attn_weights, is_causal=is_causal)

    setattr(forward, PATCHED, True)
    attention.forward = forward
    return [_RestoreForward(attention, forward)]


def _name(recorder, module: nn.Module) -> str:
    return f"Layer '{recorder.names.get(module, type(module).__name__)}' ({type(module).__name__})"


def _keep_in_graph(output: Tensor) -> Tensor:
    if not output.requires_grad:
        output.requires_grad_(True)  # book-keeping took the weights out of autograd: keep the path to the hook
    return output


def recorded_attention(attention: nn.MultiheadAttention, recorder, inputs: tuple, **options):
    query = inputs[0]
    batch = recorder.batch_size
    if query.dim() != 3 or any(x.dim() != 3 for x in inputs):
        raise UserError(f"{_name(recorder, attention)} got unbatched inputs, which have no example dimension; "
                        "call it with a batch (3-D query, key and value) or freeze it.")
    # distinct tensors among query, key, value (identity, as the module's own forward tells them apart)
    distinct = list({id(x): x for x in inputs}.values())
    batch_first = [x if attention.batch_first else x.transpose(0, 1) for x in distinct]
    if any(x.shape[0] != batch for x in batch_first):
        raise UserError(f"{_name(recorder, attention)} got inputs of shape {tuple(query.shape)} that do not hold "
                        f"the model's batch of {batch} where batch_first={attention.batch_first} puts it; "
                        "freeze it (requires_grad_(False)).")
    eye = torch.eye(attention.embed_dim, dtype=query.dtype, device=query.device)
    if not attention._qkv_same_embed_dim:  # frozen separate q/k/v weights (trainable ones are refused): as given
        seq_first = [x if not attention.batch_first else x.transpose(0, 1) for x in inputs]
        attended, weights = F.multi_head_attention_forward(
            *seq_first, attention.embed_dim, attention.num_heads, None, attention.in_proj_bias, attention.bias_k,
            attention.bias_v, attention.add_zero_attn, attention.dropout, eye, None, training=attention.training,
            use_separate_proj_weight=True, q_proj_weight=attention.q_proj_weight,
            k_proj_weight=attention.k_proj_weight, v_proj_weight=attention.v_proj_weight, **options)
    else:
        q, k, v = in_projection(attention, recorder, inputs, distinct, batch_first)
        attended, weights = F.multi_head_attention_forward(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attention.embed_dim, attention.num_heads,
            None, None, attention.bias_k, attention.bias_v, attention.add_zero_attn, attention.dropout, eye, None,
            training=attention.training, use_separate_proj_weight=True, q_proj_weight=eye, k_proj_weight=eye,
            v_proj_weight=eye, **options)
    rows = attended.transpose(0, 1)  # (B, L, E)
    output = attention.out_proj(rows)
    if attention.out_proj in recorder.tracked:
        output = _keep_in_graph(output)
        recorder.record(attention.out_proj, recorder.tracked[attention.out_proj][0], rows.detach(), output)
    return (output if attention.batch_first else output.transpose(0, 1)), weights


def in_projection(attention: nn.MultiheadAttention, recorder, inputs: tuple, distinct: list, batch_first: list):
    """(B, ·, E) q, k, v as blocks of one recorded Linear over the stacked distinct inputs."""
    stacked = batch_first[0] if len(batch_first) == 1 else torch.cat(batch_first, dim=1)
    product = F.linear(stacked, attention.in_proj_weight, attention.in_proj_bias)
    if attention in recorder.tracked:
        product = _keep_in_graph(product)
        recorder.record(attention, recorder.tracked[attention][0], stacked.detach(), product)
    span, offset = {}, 0  # each distinct input's positions in the stacked rows
    for x, rows in zip(distinct, batch_first):
        span[id(x)], offset = slice(offset, offset + rows.shape[1]), offset + rows.shape[1]
    width = attention.embed_dim
    return tuple(product[:, span[id(x)], block * width:(block + 1) * width] for block, x in enumerate(inputs))
