"""Each per-layer rule against brute-force per-example autograd, over a grid of layer shapes (SPEC §2).

The grid covers T = 1, inputs without a sequence dimension, extra leading dimensions, and shapes on both
sides of the mixed rule (ghost when 2T² < p·d, instantiated otherwise); every clipping mode is checked.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.pytorch_utils import Conv1D

from dptext.privacy import PrivacyEngine
from dptext.privacy.norms import OuterForm, find_rule, inner_product
from dptext.privacy.norms.linear import ghost_norm_sq, instantiated_norm_sq, use_ghost_form
from dptext.privacy.norms.rmsnorm import RMSNormRule

MODES = ("bookkeeping", "ghost", "per_sample")


class Probe(nn.Module):
    """layer → fixed random readout; loss_i = Σ (readout(layer(x_i)) − target_i)² over its positions."""

    def __init__(self, layer: nn.Module, width: int):
        super().__init__()
        self.layer = layer
        self.readout = torch.randn(width, 3)

    def forward(self, x):
        return self.layer(x) @ self.readout


def per_example_losses(model, x, target):
    return (model(x) - target).pow(2).flatten(1).sum(dim=1)


def linear_like(kind: str, d: int, p: int) -> nn.Module:
    return nn.Linear(d, p) if kind == "linear" else Conv1D(p, d)


def case(kind: str, shape: tuple, d: int, p: int | None = None, **kw):
    torch.manual_seed(len(shape) * 100 + d)
    if kind in ("linear", "conv1d"):
        layer, width, x = linear_like(kind, d, p), p, torch.randn(*shape, d)
        with torch.no_grad():
            layer.bias.normal_()
    elif kind == "embedding":
        layer, width = nn.Embedding(p, d, padding_idx=kw.get("padding_idx")), d
        x = torch.randint(0, p, shape)
        x[0, -1] = 0  # a padding position if padding_idx = 0
    elif kind == "layernorm":
        layer, width, x = nn.LayerNorm(d), d, torch.randn(*shape, d) * 2 + 1
        with torch.no_grad():
            layer.weight.normal_(), layer.bias.normal_()
    else:
        layer = LlamaRMSNorm(d) if kind == "llama_rmsnorm" else nn.RMSNorm(d)
        width, x = d, torch.randn(*shape, d) * 2 + 1
        with torch.no_grad():
            layer.weight.normal_()
    return Probe(layer, width), x, torch.randn(*shape, 3)


GRID = [
    ("linear", (4, 1), 3, 5), ("linear", (4, 2), 3, 5), ("linear", (4, 4), 3, 5), ("linear", (3, 7), 16, 8),
    ("linear", (3, 9), 16, 8), ("linear", (4,), 6, 4), ("linear", (2, 2, 3), 4, 5),
    ("conv1d", (4, 1), 3, 5), ("conv1d", (3, 2), 3, 5), ("conv1d", (3, 6), 5, 4), ("conv1d", (4,), 6, 4),
    ("embedding", (4, 1), 3, 7), ("embedding", (4, 9), 3, 7), ("layernorm", (4, 1), 5), ("layernorm", (3, 6), 5),
    ("layernorm", (4,), 5), ("llama_rmsnorm", (4,), 5), ("llama_rmsnorm", (3, 6), 5), ("llama_rmsnorm", (4, 1), 5),
    ("torch_rmsnorm", (3, 4), 6),
]


def brute_force_clipped(model, x, target, clip):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = [torch.autograd.grad(per_example_losses(model, x[i:i + 1], target[i:i + 1]).sum(),
                                [p for _, p in named]) for i in range(len(x))]
    norms = torch.stack([torch.stack([g.pow(2).sum() for g in row]).sum().sqrt() for row in rows])
    coef = (clip / (norms + 1e-6)).clamp(max=1)
    return norms, {n: sum(c * row[k] for c, row in zip(coef, rows)) for k, (n, _) in enumerate(named)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind,shape,d,p", [g if len(g) == 4 else (*g, None) for g in GRID])
def test_rule_matches_brute_force(kind, shape, d, p, mode):
    model, x, target = case(kind, shape, d, p, padding_idx=0)
    reference = copy.deepcopy(model)
    clip = 1.0
    norms, expected = brute_force_clipped(reference, x, target, clip)
    engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0,
                           max_grad_norm=clip, expected_batch_size=len(x), dataset_size=10 * len(x),
                           clipping_mode=mode, verify=False)
    got_norms = engine.accumulate(per_example_losses(model, x, target))
    torch.testing.assert_close(got_norms, norms, rtol=1e-4, atol=1e-6)
    got = engine.clipped_grads()
    errors = {n: float((got[param] - expected[n]).abs().max()) for n, param in model.named_parameters()}
    scale = max(float(e.abs().max()) for e in expected.values())
    assert all(err <= 1e-4 * scale for err in errors.values()), f"per-parameter max abs errors: {errors}"


def test_grid_takes_both_sides_of_the_mixed_rule():
    sides = {use_ghost_form(shape[1] if len(shape) > 1 else 1, p, d)
             for kind, shape, d, *rest in GRID if kind in ("linear", "conv1d") for p in rest}
    assert sides == {True, False}


@pytest.mark.parametrize("positions", [1, 2, 5, 33])
def test_ghost_and_instantiated_norms_agree(positions):
    a, g = torch.randn(3, positions, 7), torch.randn(3, positions, 4)
    torch.testing.assert_close(ghost_norm_sq(a, g), instantiated_norm_sq(a, g), rtol=1e-5, atol=1e-5)
    explicit = torch.stack([(g[i].T @ a[i]).pow(2).sum() for i in range(3)])
    torch.testing.assert_close(ghost_norm_sq(a, g), explicit, rtol=1e-5, atol=1e-5)


def test_tied_cross_term_without_the_vocabulary_matrix():
    """⟨G_emb, G_head⟩ = Σ_s Σ_t g^head_t[x_s]·(a_t·g^emb_s), checked against the explicit V×d matrices."""
    batch, vocab, width = 3, 11, 4
    ids = torch.randint(0, vocab, (batch, 6))
    ids[0, 2] = -1  # a padding position
    g_emb, a_head, g_head = torch.randn(batch, 6, width), torch.randn(batch, 5, width), torch.randn(batch, 5, vocab)
    embedding, head = OuterForm(left=ids, right=g_emb), OuterForm(left=g_head, right=a_head)
    explicit = []
    for i in range(batch):
        grad_emb = torch.zeros(vocab, width)
        keep = ids[i] >= 0
        grad_emb.index_add_(0, ids[i][keep], g_emb[i][keep])
        explicit.append((grad_emb * (g_head[i].T @ a_head[i])).sum())
    torch.testing.assert_close(inner_product(embedding, head), torch.stack(explicit), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(inner_product(head, embedding), torch.stack(explicit), rtol=1e-5, atol=1e-5)


class RMSNormLookalike(nn.Module):
    """Has a weight and an eps like RMSNorm but subtracts the mean: must not get the RMSNorm rule."""

    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = 1e-6

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return self.weight * x * (x.pow(2).mean(-1, keepdim=True) + self.eps).rsqrt()


class GemmaStyleRMSNorm(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return (1 + self.weight) * x * (x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon).rsqrt()


def test_rmsnorm_is_recognised_by_structure_and_verified_by_value():
    assert isinstance(find_rule(LlamaRMSNorm(8)), RMSNormRule)
    assert isinstance(find_rule(GemmaStyleRMSNorm(8)), RMSNormRule)
    assert find_rule(RMSNormLookalike(8)) is None


def test_subclass_overriding_forward_gets_no_rule():
    class DoubledLinear(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    class PlainSubclass(nn.Linear):
        pass

    assert find_rule(DoubledLinear(2, 2)) is None
    assert find_rule(PlainSubclass(2, 2)) is not None


def test_embedding_options_that_break_per_example_gradients_are_refused():
    from dptext.errors import UserError

    model = nn.Sequential(nn.Embedding(5, 3, scale_grad_by_freq=True))
    with pytest.raises(UserError, match="scale_grad_by_freq"):
        PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                      expected_batch_size=2, dataset_size=10, verify=False)
