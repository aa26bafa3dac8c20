"""Per-example gradients that are sums of outer products over positions, and their inner products.

Linear, Conv1D and Embedding all have per-example weight gradients of the form
G_i = Σ_t left_{i,t} ⊗ right_{i,t} (SPEC §2): for Linear left = g (output grads) and right = a (inputs);
Conv1D stores W transposed, so left = a and right = g; for an Embedding, left_t is the one-hot row of the
token id x_t and right = g. Two such gradients of the same parameter have the inner product
    ⟨G_u, G_v⟩ = Σ_{s,t} (left_u,s · left_v,t) (right_u,s · right_v,t),
which never forms a p×d (or V×d) matrix but holds T_u×T_v ones. With one-hot lefts, left_u,s · left_v,t is a
lookup: the dense left at row x_s, so ⟨G_emb, G_head⟩ = Σ_s Σ_t g^head_t[x_s] · (a_t · g^emb_s). This is the
cross term of a shared (tied) parameter. As for a layer's own norm (SPEC §2's mixed rule), ``inner_product``
forms a dense side's gradient instead where it is the smaller (long sequences):
⟨G_emb, G_head⟩ = Σ_s g^emb_s · G_head[x_s].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class OuterForm:
    """G_i = Σ_t left_{i,t} ⊗ right_{i,t}. ``left`` is dense (B, T, m) or integer ids (B, T) meaning one-hot
    rows, where an id < 0 stands for a position without gradient (padding_idx)."""

    left: Tensor
    right: Tensor

    @property
    def left_is_ids(self) -> bool:
        return not self.left.is_floating_point()


def _ids_against_dense(ids: Tensor, dense: Tensor) -> Tensor:
    """(B, T_ids, T_dense): one-hot(ids_s) · dense_t = dense_t[ids_s], zero where ids_s < 0."""
    batch, positions = ids.shape
    index = ids.clamp(min=0)[:, None, :].expand(batch, dense.shape[1], positions)
    looked_up = torch.gather(dense.float(), 2, index)  # (B, T_dense, T_ids)
    return (looked_up * (ids >= 0)[:, None, :]).transpose(1, 2)


def left_gram(u: OuterForm, v: OuterForm) -> Tensor:
    """(B, T_u, T_v) matrix of left_u,s · left_v,t."""
    if u.left_is_ids and v.left_is_ids:
        same = u.left[:, :, None] == v.left[:, None, :]
        return (same & (u.left >= 0)[:, :, None]).float()
    if u.left_is_ids:
        return _ids_against_dense(u.left, v.left)
    if v.left_is_ids:
        return _ids_against_dense(v.left, u.left).transpose(1, 2)
    return torch.bmm(u.left.float(), v.left.float().transpose(1, 2))


def inner_product(u: OuterForm, v: OuterForm) -> Tensor:
    """(B,) per-example ⟨G_u, G_v⟩ in fp32. The Gram form costs O(T_u·T_v) memory (several (B, T_u, T_v) matrices:
    64 MiB each per example at T = 4096); where a dense side's m×n gradient is smaller than twice that (SPEC §2's
    mixed rule, as for a layer's own norm), it is instantiated and the other side reads it (``_instantiated``).
    A tied LM head of vocabulary V and width d against its embedding then costs O(V·d + T·d), not O(T²)."""
    if not (u.left_is_ids and v.left_is_ids):
        dense = v if u.left_is_ids else u
        if dense.left.shape[2] * dense.right.shape[2] <= 2 * u.left.shape[1] * v.left.shape[1]:
            return _instantiated(u, v)
    right_gram = torch.bmm(u.right.float(), v.right.float().transpose(1, 2))
    return (left_gram(u, v) * right_gram).sum(dim=(1, 2))


def _instantiated(u: OuterForm, v: OuterForm) -> Tensor:
    """⟨G_u, G_v⟩ with a dense side's (B, m, n) gradient formed: against ids, Σ_s right_s · G[x_s] (rows looked up,
    none for ids < 0); against a dense form, Σ G_u ⊙ G_v."""
    if u.left_is_ids:
        u, v = v, u
    grad = torch.bmm(u.left.float().transpose(1, 2), u.right.float())  # (B, m, n)
    if not v.left_is_ids:
        other = grad if v is u else torch.bmm(v.left.float().transpose(1, 2), v.right.float())
        return (grad * other).sum(dim=(1, 2))
    ids = v.left
    rows = torch.gather(grad, 1, ids.clamp(min=0)[:, :, None].expand(-1, -1, grad.shape[2]))  # (B, T, n)
    return (rows * v.right.float() * (ids >= 0)[:, :, None]).sum(dim=(1, 2))
