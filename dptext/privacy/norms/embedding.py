"""nn.Embedding: row x_t of W ∈ R^{V×d} is looked up at each position t.

The per-example gradient adds g_t to row x_t: G_i = Σ_t onehot(x_t) g_tᵀ, and positions holding
``padding_idx`` contribute nothing (torch never updates that row). SPEC §2 writes its squared norm as
‖G_i‖² = Σ_{s,t} 1[x_s = x_t] (g_s·g_t); we use the equivalent O(T·d) id-grouping form: sum the g_t of equal
ids within each example (index_add over (example, id) keys), then square. Neither form touches the V×d matrix.
The clipped sum is one index_add of the weighted g_t into W's rows.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dptext.privacy.norms.outer import OuterForm
from dptext.privacy.norms.registry import register_rule

NO_ROW = -1  # an id that receives no gradient (padding_idx)


def row_sums_per_example(ids: Tensor, g: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    """Group positions by (example, id): returns (example of each group, Σ_t g_t of each group)."""
    batch, positions = ids.shape
    keep = ids.reshape(-1) >= 0
    example = torch.arange(batch, device=ids.device).repeat_interleave(positions)
    keys = (example * vocab_size + ids.reshape(-1))[keep]
    groups, group_of_position = torch.unique(keys, return_inverse=True)
    summed = torch.zeros(len(groups), g.shape[-1], device=g.device, dtype=torch.float32)
    summed.index_add_(0, group_of_position, g.reshape(-1, g.shape[-1])[keep].float())
    return groups // vocab_size, summed


@register_rule(nn.Embedding)
class EmbeddingRule:
    def unsupported(self, module: nn.Embedding) -> str | None:
        if module.max_norm is not None:
            return "max_norm rewrites rows in the forward pass"
        if module.scale_grad_by_freq:
            return "scale_grad_by_freq makes one example's gradient depend on the batch's other ids"
        if module.sparse:
            return "sparse gradients are not supported"
        return None

    def keep(self, module: nn.Embedding, inputs: tuple) -> Tensor:
        ids = inputs[0]
        if module.padding_idx is not None:
            ids = ids.masked_fill(ids == module.padding_idx, NO_ROW)
        return ids.flatten(1) if ids.ndim > 1 else ids[:, None]  # (B, ids per example); reshape(B, -1) fails at B = 0

    def norm_sq(self, module, names, ids, grad_output) -> dict[str, Tensor]:
        g = grad_output.reshape(ids.shape[0], ids.shape[1], -1)
        example_of_group, summed = row_sums_per_example(ids, g, module.num_embeddings)
        norms = torch.zeros(ids.shape[0], device=g.device, dtype=torch.float32)
        return {"weight": norms.index_add_(0, example_of_group, summed.pow(2).sum(dim=1))}

    def clipped_sum(self, module, names, ids, grad_output, coef) -> dict[str, Tensor]:
        total = torch.zeros(module.num_embeddings, grad_output.shape[-1], device=grad_output.device,
                            dtype=grad_output.dtype)
        return {"weight": self.add_clipped_sum(total, module, ids, grad_output, coef["weight"])}

    def add_clipped_sum(self, total: Tensor, module, ids, grad_output, coef: Tensor) -> Tensor:
        """``total`` += this use's clipped sum, in place: a tied embedding adds its rows straight into the LM
        head's V×d sum (``clipping.sums.clipped_sums``) instead of a zero-filled third V×d matrix."""
        g = grad_output.reshape(ids.shape[0], ids.shape[1], -1)
        weighted = (g * coef.to(g.dtype)[:, None, None]).reshape(-1, g.shape[-1])
        keep = ids.reshape(-1) >= 0
        return total.index_add_(0, ids.reshape(-1)[keep], weighted[keep].to(total.dtype))

    def per_example(self, module, names, ids, grad_output) -> dict[str, Tensor]:
        batch, positions = ids.shape
        g = grad_output.reshape(batch, positions, -1)
        keep = ids.reshape(-1) >= 0
        example = torch.arange(batch, device=ids.device).repeat_interleave(positions)
        rows = (example * module.num_embeddings + ids.reshape(-1))[keep]
        grads = torch.zeros(batch * module.num_embeddings, g.shape[-1], device=g.device, dtype=g.dtype)
        grads.index_add_(0, rows, g.reshape(-1, g.shape[-1])[keep])
        return {"weight": grads.reshape(batch, module.num_embeddings, -1)}

    def outer_form(self, module, names, ids, grad_output) -> dict[str, OuterForm]:
        return {"weight": OuterForm(left=ids, right=grad_output.reshape(ids.shape[0], ids.shape[1], -1))}
