"""The scaled proof (issue 42): one numeric comparison per use pattern, every layer checked structurally.

``dptext.privacy.proof.patterns.representatives`` decides which layer's comparison with brute-force per-example
autograd stands for which; these tests check that pattern-mates share a verdict (a refusal found on the
representative refuses them all), that per-instance code (a hook, a replaced forward) makes a layer its own
representative so a problem in one decoder layer only is still found, and that the large-model path (the model's
own fp32 precision, ``FP64_PARAMETERS`` forced to 0) refuses and accepts the same models as the fp64 path.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptext.errors import UserError
from dptext.models import load_model
from dptext.privacy import PrivacyEngine
from dptext.privacy.proof import verify as verify_module
from dptext.privacy.proof.patterns import pattern_name, representatives
from dptext.privacy.proof.synthetic import output_functional_loss, synthetic_token_batch

CLIP = 0.05


class MixRows(torch.autograd.Function):
    """Identity forward; the backward pass adds half of the next example's gradient to each example's: the
    forward rows stay independent, so only the numeric comparison can see it."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad + 0.5 * grad.roll(1, dims=0)


class Block(nn.Module):
    def __init__(self, width: int, mix: bool):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.mix = mix

    def forward(self, h):
        out = self.fc(h)
        return MixRows.apply(out) if self.mix else out


class BufferSwitched(nn.Module):
    def __init__(self, width: int, on: bool):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.register_buffer("switch", torch.tensor([1.0 if on else 0.0]))

    def forward(self, h):
        out = self.fc(h)
        return MixRows.apply(out) if bool(self.switch > 0) else out


class Stack(nn.Module):
    """Embedding → two blocks of one class, in sequence or side by side (``parallel``: each reads the embedding
    and their outputs are added, so nothing in the second block reaches the first one's gradient); ``mix`` makes
    the blocks' own code mix examples."""

    def __init__(self, mix: bool = False, parallel: bool = False, vocab: int = 13, width: int = 6):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, mix) for _ in range(2))
        self.parallel = parallel
        if parallel:
            self.embed.requires_grad_(False)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        if self.parallel:
            return sum(torch.tanh(block(h)) for block in self.blocks)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return h


def engine_for(model, mode="bookkeeping", layout="all_layer"):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return PrivacyEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=CLIP, expected_batch_size=4,
                         dataset_size=100, clipping_mode=mode, clipping_layout=layout)


def tiny_llama():
    model = load_model("tiny-llama", head="causal_lm")[0]
    model.train()
    return model


@pytest.fixture(params=["fp64", "own-precision"])
def proof_precision(request, monkeypatch):
    """Both paths of the probe: an fp64 copy (small models) and the model's own precision (large ones)."""
    if request.param == "own-precision":
        monkeypatch.setattr(verify_module, "FP64_PARAMETERS", 0)
    return request.param


def test_pattern_names_replace_every_block_index():
    assert pattern_name("model.layers.3.self_attn.q_proj") == "model.layers.*.self_attn.q_proj"
    assert pattern_name("encoder.block.0.layer.1.DenseReluDense.wi") == "encoder.block.*.layer.*.DenseReluDense.wi"
    assert pattern_name("0.weight") == "*.weight" and pattern_name("lm_head") == "lm_head"


def test_decoder_layers_share_their_first_layers_verdict_and_tied_weights_are_compared_themselves():
    model = tiny_llama()
    engine = engine_for(model)
    decided = representatives(model, engine.tracked, engine.names, verify_module.engine_hooks(engine))
    layers = model.model.layers
    assert decided[layers[1].self_attn.q_proj] is layers[0].self_attn.q_proj
    assert decided[layers[1].mlp.down_proj] is layers[0].mlp.down_proj
    assert decided[layers[0].self_attn.q_proj] is layers[0].self_attn.q_proj
    assert decided[model.model.embed_tokens] is model.model.embed_tokens  # tied to the head: its own pattern
    report = engine.verify()
    assert report.compared < len(engine.tracked)
    assert {row.status for row in report.rows.values()} == {"exact"}


def test_a_hook_on_one_layer_makes_it_its_own_representative_and_is_refused(proof_precision):
    model = tiny_llama()
    if proof_precision == "fp64":
        model.double()
    target = model.model.layers[1].mlp.down_proj
    target.register_forward_hook(lambda module, args, output: MixRows.apply(output))
    engine = engine_for(model)
    decided = representatives(model, engine.tracked, engine.names, verify_module.engine_hooks(engine))
    assert decided[target] is target
    report = verify_module.probe(engine)  # everything upstream of it gets mixed gradients too
    assert target in {module for module, row in report.rows.items() if row.status == "refused"}
    with pytest.raises(UserError, match="refused layer"):
        engine.verify()


@pytest.mark.parametrize("how", ["forward", "hook", "setting", "list", "buffer"])
def test_a_problem_in_the_second_of_two_parallel_blocks_is_found_by_comparing_it_itself(how):
    """Side by side, nothing wrong in block 1 reaches block 0's gradient: only block 1's own comparison sees it,
    so per-instance code or settings must make it its own representative (else it would share block 0's
    "exact")."""
    model = Stack(parallel=True)
    second = model.blocks[1]
    if how == "forward":
        plain = second.forward
        second.forward = lambda h: MixRows.apply(plain(h))
    elif how == "setting":  # the class's own code, switched on by a plain attribute of one instance
        second.mix = True
    elif how == "list":
        second.mix = [True]
    elif how == "buffer":  # the switch is a buffer of the instance
        model.blocks = nn.ModuleList(BufferSwitched(6, on) for on in (False, True))
        second = model.blocks[1]
    else:
        second.register_forward_hook(lambda module, args, output: MixRows.apply(output))
    engine = engine_for(model.double())
    decided = representatives(model, engine.tracked, engine.names, verify_module.engine_hooks(engine))
    assert decided[second.fc] is second.fc
    report = verify_module.probe(engine)
    assert [row.name for row in report.refused()] == ["blocks.1.fc"]


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
def test_pattern_mates_share_a_refusal_found_on_the_representative(mode, proof_precision):
    model = Stack(mix=True)
    if proof_precision == "fp64":
        model.double()
    engine = engine_for(model, mode)
    decided = representatives(model, engine.tracked, engine.names, verify_module.engine_hooks(engine))
    assert decided[model.blocks[1].fc] is model.blocks[0].fc
    report = verify_module.probe(engine)
    refused = {row.name: row.why for row in report.refused()}
    assert "blocks.0.fc" in refused
    assert "blocks.1.fc" in refused and "whose use pattern it shares" in refused["blocks.1.fc"]


@pytest.mark.parametrize("mode,layout", [("bookkeeping", "all_layer"), ("bookkeeping", "per_layer"),
                                         ("ghost", "all_layer"), ("per_sample", "all_layer")])
def test_the_own_precision_proof_accepts_an_exact_model_whose_sums_are_exact(mode, layout, monkeypatch):
    """The large-model path on an fp32 tiny Llama: passes, and the clipped sums it let through equal brute force's
    for every parameter (compared ones and pattern-mates alike)."""
    monkeypatch.setattr(verify_module, "FP64_PARAMETERS", 0)
    model = tiny_llama()
    engine = engine_for(model, mode, layout)
    report = engine.verify()
    assert report.compared < len(engine.tracked)
    batch = synthetic_token_batch(model)(5, 7, torch.Generator().manual_seed(3))
    engine.zero_grad()
    engine.accumulate(output_functional_loss(model, batch))
    sums = engine.clipped_grads()
    engine.zero_grad()
    params = engine.params
    expected = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    with torch.enable_grad():
        for p in params:
            p.requires_grad_(True)
        for i in range(5):
            row = {k: v[i:i + 1] for k, v in batch.items()}
            grads = torch.autograd.grad(output_functional_loss(model, row).sum(), params, allow_unused=True)
            grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
            if layout == "all_layer":
                norm = sum(float(g.double().pow(2).sum()) for g in grads) ** 0.5
                factors = [min(1.0, CLIP / (norm + 1e-6))] * len(grads)
            else:
                threshold = CLIP / len(params) ** 0.5
                factors = [min(1.0, threshold / (float(g.double().norm()) + 1e-6)) for g in grads]
            for total, g, f in zip(expected, grads, factors):
                total.add_(g.double(), alpha=f)
    for p, want in zip(params, expected):
        got = sums.get(p, torch.zeros_like(p)).double()
        assert float((got - want).norm()) <= 1e-3 * float(want.norm()) + 1e-6
