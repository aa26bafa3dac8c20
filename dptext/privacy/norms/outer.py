"""Per-example gradients that are sums of outer products over positions, and their inner products.

Linear, Conv1D and Embedding all have per-example weight gradients of the form
G_i = Σ_t left_{i,t} ⊗ right_{i,t} (SPEC §2): for Linear left = g (output grads) and right = a (inputs);
Conv1D stores W transposed, so left = a and right = g; for an Embedding, left_t is the one-hot row of the
token id x_t and right = g. Two such gradients of the same parameter have the inner product
    ⟨G_u, G_v⟩ = Σ_{s,t} (left_u,s · left_v,t) (right_u,s · right_v,t),
which never forms a p×d (or V×d) matrix. With one-hot lefts, left_u,s · left_v,t is a lookup:
the dense left at row x_s, so ⟨G_emb, G_head⟩ = Σ_s Σ_t g^head_t[x_s] · (a_t · g^emb_s).
This is the cross term of a shared (tied) parameter.
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
    """(B,) per-example ⟨G_u, G_v⟩ in fp32, O(T_u·T_v·(m + n)) time, O(T_u·T_v) memory."""
    right_gram = torch.bmm(u.right.float(), v.right.float().transpose(1, 2))
    return (left_gram(u, v) * right_gram).sum(dim=(1, 2))
