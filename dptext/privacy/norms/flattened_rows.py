"""Layers that a model calls on its batch flattened to rows: OPT's decoder layers reshape the (B, T, d) hidden
states to (B·T, d) before ``final_layer_norm``, ``fc1`` and ``fc2``.

The rows are tokens, not examples, so the plain rules (which take dim 0 as the batch) would see B·T examples.
The flattening is a plain ``reshape(-1, d)`` of a contiguous (B, T, d) tensor, so row r belongs to example
r // T: grouping the rows back to (B, T, ...), both the kept activation and the output gradient, gives the
inner rule (Linear, LayerNorm) exactly what it gets from an unflattened layer. B is the model call's batch
(from its inputs), never guessed from the row count; a row count that B does not divide is refused.
This rule is attached by parent class and attribute (OPTDecoderLayer.fc1, ...), not to every Linear.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dptext.errors import UserError
from dptext.privacy.norms.layernorm import LayerNormRule
from dptext.privacy.norms.linear import LinearRule
from dptext.privacy.norms.registry import register_child_rule

OPT_DECODER_LAYER = "transformers.models.opt.modeling_opt.OPTDecoderLayer"


class ExampleMajorRowsRule:
    inner = None  # the rule of the layer itself; every computation is delegated to it

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def install(self, module: nn.Module, recorder, root: nn.Module) -> list:
        return [module.register_forward_hook(self._regroup_rows(recorder))]

    def _regroup_rows(self, recorder):
        def after_call(module, args, output):
            if not recorder.active():
                return None
            batch, rows = recorder.batch_size, output.shape[0]
            if not batch or rows % batch:
                raise UserError(f"Layer '{recorder.names.get(module)}' ({type(module).__name__}) got {rows} rows, "
                                f"not a multiple of the batch of {batch}; freeze it (requires_grad_(False)).")
            if not output.requires_grad:
                output.requires_grad_(True)  # book-keeping took the weights out of autograd: keep the path
            with torch.no_grad():
                kept = self.inner.keep(module, tuple(x.detach() if isinstance(x, Tensor) else x for x in args))
            recorder.record(module, self, kept.reshape(batch, rows // batch, *kept.shape[1:]), output,
                            grad_view=lambda grad: grad.reshape(batch, rows // batch, *grad.shape[1:]))
            return None

        return after_call


@register_child_rule(OPT_DECODER_LAYER, "fc1")
class OPTFeedForwardInRule(ExampleMajorRowsRule):
    inner = LinearRule()


@register_child_rule(OPT_DECODER_LAYER, "fc2")
class OPTFeedForwardOutRule(ExampleMajorRowsRule):
    inner = LinearRule()


@register_child_rule(OPT_DECODER_LAYER, "final_layer_norm")
class OPTFinalNormRule(ExampleMajorRowsRule):
    inner = LayerNormRule()
