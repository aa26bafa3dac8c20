"""torch's ``nn.MultiheadAttention``: refused, with the reason.

Its forward hands the raw weights to ``F.multi_head_attention_forward``, which projects q, k, v with
``in_proj_weight`` and the result with ``out_proj.weight`` as plain tensors: ``out_proj`` is never called as a
module and the projected inputs never pass a hook, so no recorded activation or output gradient belongs to
these parameters (and a rule for ``out_proj`` as a Linear would see nothing, silently). Both the attention
module and its ``out_proj`` are therefore refused by name; freezing them, or building attention from
``nn.Linear`` projections (as every Hugging Face model does), trains exactly.
"""

from __future__ import annotations

from torch import nn

from dptext.privacy.norms.registry import qualified_name, register_child_rule, register_rule

REASON = ("nn.MultiheadAttention applies its projection weights inside F.multi_head_attention_forward, where no "
          "hook sees their inputs or outputs (use nn.Linear projections instead)")


@register_rule(nn.MultiheadAttention)
class MultiheadAttentionRule:
    def unsupported(self, module) -> str:
        return REASON


@register_child_rule(qualified_name(nn.MultiheadAttention), "out_proj")
class MultiheadAttentionOutRule(MultiheadAttentionRule):
    pass
