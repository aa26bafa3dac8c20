"""Layers whose input is not batch-first, attached by parent class and attribute (never to every Linear):

* rows flattened from the batch: OPT's decoder layers reshape the (B, T, d) hidden states to (B·T, d) before
  ``final_layer_norm``, ``fc1`` and ``fc2``;
* sequence-first inputs: Longformer's self-attention transposes the hidden states to (T, B, d) before its
  query/key/value projections (and the global ones).

The rows are tokens, not examples, so the plain rules (which take dim 0 as the batch) would see B·T examples.
The flattening is a plain ``reshape(-1, d)`` of a contiguous (B, T, d) tensor, so row r belongs to example
r // T: grouping the rows back to (B, T, ...), both the kept activation and the output gradient, gives the
inner rule (Linear, LayerNorm) exactly what it gets from an unflattened layer. B is the model call's batch
(from its inputs), never guessed from the row count; a row count that B does not divide is refused.
A sequence-first (T, B, ...) layer is the same with the first two dimensions swapped back. When B = T the
shapes alone could not tell the two apart; the rule knows the layout from the model's code.
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
    """Rows r = b·T + t of a flattened (B, T, ...) batch; ``inner`` is the layer's own rule."""

    inner = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def install(self, module: nn.Module, recorder, root: nn.Module) -> list:
        return [module.register_forward_hook(self._regroup(recorder))]

    def batch_first(self, x: Tensor, batch: int) -> Tensor:
        return x.reshape(batch, x.shape[0] // batch, *x.shape[1:])

    def fits(self, output: Tensor, batch: int) -> bool:
        return output.shape[0] % batch == 0

    def _regroup(self, recorder):
        def after_call(module, args, output):
            if not recorder.active():
                return None
            batch = recorder.batch_size
            if not batch or not self.fits(output, batch):
                raise UserError(f"Layer '{recorder.names.get(module)}' ({type(module).__name__}) got an output of "
                                f"shape {tuple(output.shape)} that does not hold the batch of {batch} where its "
                                "model puts it; freeze it (requires_grad_(False)).")
            if not output.requires_grad:
                output.requires_grad_(True)  # book-keeping took the weights out of autograd: keep the path
            with torch.no_grad():
                kept = self.inner.keep(module, tuple(x.detach() if isinstance(x, Tensor) else x for x in args))
            recorder.record(module, self, self.batch_first(kept, batch), output,
                            grad_view=lambda grad: self.batch_first(grad, batch))
            return None

        return after_call


class SequenceFirstRule(ExampleMajorRowsRule):
    """Inputs (T, B, ...): the batch is dimension 1."""

    def batch_first(self, x: Tensor, batch: int) -> Tensor:
        return x.transpose(0, 1)

    def fits(self, output: Tensor, batch: int) -> bool:
        return output.ndim >= 3 and output.shape[1] == batch


@register_child_rule(OPT_DECODER_LAYER, "fc1")
class OPTFeedForwardInRule(ExampleMajorRowsRule):
    inner = LinearRule()


@register_child_rule(OPT_DECODER_LAYER, "fc2")
class OPTFeedForwardOutRule(ExampleMajorRowsRule):
    inner = LinearRule()


@register_child_rule(OPT_DECODER_LAYER, "final_layer_norm")
class OPTFinalNormRule(ExampleMajorRowsRule):
    inner = LayerNormRule()


LONGFORMER_ATTENTION = "transformers.models.longformer.modeling_longformer.LongformerSelfAttention"


@register_child_rule(LONGFORMER_ATTENTION, "query")
@register_child_rule(LONGFORMER_ATTENTION, "key")
@register_child_rule(LONGFORMER_ATTENTION, "value")
@register_child_rule(LONGFORMER_ATTENTION, "query_global")
@register_child_rule(LONGFORMER_ATTENTION, "key_global")
@register_child_rule(LONGFORMER_ATTENTION, "value_global")
class LongformerProjectionRule(SequenceFirstRule):
    inner = LinearRule()
