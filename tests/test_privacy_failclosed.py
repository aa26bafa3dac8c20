"""The fail-closed engine (issues 14 and 23): every pattern is exact against brute force or refused, never wrong.

Tiny fp64 modules built here, through the public API (``PrivacyEngine``, ``engine.verify()``), in all three
clipping modes and both layouts. "Exact" is checked against per-example autograd and by the remove-one-example
sensitivity test (‖Σ clipped(D) − Σ clipped(D − {j})‖ ≤ C); "refused" must name the layer.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from dptext.cli.app import main
from dptext.errors import UserError
from dptext.models import load_model
from dptext.privacy import PrivacyEngine
from dptext.privacy.proof.model_check import check_model
from dptext.privacy.proof.synthetic import output_functional_loss, synthetic_token_batch

CASES = [(mode, layout) for mode in ("bookkeeping", "ghost", "per_sample") for layout in ("all_layer", "per_layer")
         if not (mode == "ghost" and layout == "per_layer")]
CLIP = 0.05
VOCAB, WIDTH = 11, 6


class Tiny(nn.Module):
    """Embedding → body → output; ``body(h, module)`` is the pattern under test."""

    def __init__(self, body=None, extra: nn.Module | None = None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.extra = extra
        self.body = body or (lambda h, m: m.fc(h))

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None):
        return self.body(self.embed(input_ids), self)


def make_engine(model, mode, layout="all_layer", **kwargs):
    model = model.double()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    engine = PrivacyEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=CLIP, expected_batch_size=4,
                           dataset_size=100, clipping_mode=mode, clipping_layout=layout, **kwargs, verify=False)
    return engine, optimizer


def clipped_sum(engine, batch, rows):
    engine.zero_grad()
    loss = output_functional_loss(engine.model, {k: v[rows] for k, v in batch.items()})
    engine.accumulate(loss)
    sums = engine.clipped_grads()
    engine.zero_grad()
    return sums


def assert_sensitivity(engine, batch):
    """Removing any one example moves the clipped sum by at most C."""
    full = clipped_sum(engine, batch, slice(None))
    examples = batch["input_ids"].shape[0]
    for j in range(examples):
        rows = torch.tensor([i for i in range(examples) if i != j])
        rest = clipped_sum(engine, batch, rows)
        moved = sum(float((full[p] - rest.get(p, torch.zeros_like(full[p]))).pow(2).sum()) for p in full) ** 0.5
        assert moved <= CLIP * (1 + 1e-6)


def verify_outcome(model, mode, layout="all_layer"):
    """'exact' (probe passed and the sensitivity test holds) or the refusal's message."""
    engine, _ = make_engine(model, mode, layout)
    try:
        engine.verify()
    except UserError as error:
        return str(error)
    batch = synthetic_token_batch(model)(5, 7, torch.Generator().manual_seed(5))
    assert_sensitivity(engine, batch)
    return "exact"


def relu_inplace(h, m):
    return F.relu(m.fc(h), inplace=True)


def mul_inplace(h, m):
    return m.fc(h).mul_(2.0)


def add_to_output_slice(h, m):  # += on a view of the output (the output itself is a view of F.linear's product)
    out = m.fc(h)
    out[:, :, :3] += torch.tanh(h[:, :, 3:])
    return out


def view_of_output_scaled(h, m):  # in place through a reshaped view, as Longformer's `/=` on its projection
    out = m.fc(h)
    out.view(-1).mul_(0.5)
    return out


def linear_of_2d_rows_relu(h, m):  # a 2-D output is not a view: the hook sits on the product itself
    return torch.stack([F.relu(m.fc(row), inplace=True) for row in h.unbind(1)], dim=1)


def input_changed_after_the_layer(h, m):  # the kept activation is not what the weight saw (book-keeping)
    h = h * 1.0
    out = m.fc(h)
    h.add_(1.0)
    return out + h


class SlicedProjection(nn.Module):
    """A layer without a rule whose output is a view of a larger tensor (per_sample's torch.func fallback)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, 2 * WIDTH) / WIDTH)

    def forward(self, x):
        return (x @ self.weight)[..., :WIDTH]


def sliced_output_scaled(h, m):  # an in-place change of that view bypasses the node a hook on it sits on
    return m.extra(h).mul_(2.0)


def functional_head(h, m):  # the embedding weight read again outside its module, as an LM head
    return F.linear(m.fc(h), m.embed.weight)


def shared_weight(h, m):  # a second Linear holding the first one's weight, no cross-term rule needed
    return m.extra(m.fc(h))


def sequence_first(h, m):  # the layer sees (T, B, d): rows are positions
    return m.fc(h.transpose(0, 1)).transpose(0, 1)


def gathered_rows(h, m):  # an "expert" fed the tokens of all examples as rows
    flat = h.reshape(-1, h.shape[-1])
    return m.fc(flat[flat[:, 0] > -1e9]).reshape(h.shape)


def keyword_input(h, m):
    return m.fc(input=h)


@pytest.mark.parametrize("mode,layout", CASES)
@pytest.mark.parametrize("body,fragment", [
    (functional_head, "'embed'"), (sequence_first, "'fc'"), (gathered_rows, "'fc'")])
def test_broken_patterns_are_refused_with_the_layer_name(body, fragment, mode, layout):
    outcome = verify_outcome(Tiny(body), mode, layout)
    assert outcome != "exact" and fragment in outcome


def brute_force_clipped_sum(model, batch, params, layout):
    """Σ_i clip(g_i) from one autograd pass per example, clipped as the engine clips (SPEC §1)."""
    total = [torch.zeros_like(p) for p in params]
    for i in range(batch["input_ids"].shape[0]):
        loss = output_functional_loss(model, {k: v[i:i + 1] for k, v in batch.items()}).sum()
        grads = [torch.zeros_like(p) if g is None else g
                 for g, p in zip(torch.autograd.grad(loss, params, allow_unused=True), params)]
        if layout == "all_layer":
            norm = sum(float(g.pow(2).sum()) for g in grads) ** 0.5
            factors = [min(1.0, CLIP / (norm + 1e-6))] * len(grads)
        else:
            factors = [min(1.0, CLIP / len(grads) ** 0.5 / (float(g.norm()) + 1e-6)) for g in grads]
        for summed, g, factor in zip(total, grads, factors):
            summed += factor * g
    return total


@pytest.mark.parametrize("mode,layout", CASES)
@pytest.mark.parametrize("body", [relu_inplace, mul_inplace, add_to_output_slice, view_of_output_scaled,
                                  linear_of_2d_rows_relu])
def test_outputs_changed_in_place_are_exact_even_without_the_probe(body, mode, layout):
    # A gradient hook registered before an in-place change gets the gradient of the value the weight produced.
    # Before, the hook sat on F.linear's (B, T, p) view, which an in-place change bypasses: the layer's use
    # vanished and the clipped sum was off by more than C (the helper's 0.8·C report, reproduced).
    torch.manual_seed(3)
    model = Tiny(body).double()
    batch = synthetic_token_batch(model)(5, 7, torch.Generator().manual_seed(5))
    params = list(model.parameters())
    expected = brute_force_clipped_sum(model, batch, params, layout)
    engine, _ = make_engine(model, mode, layout)
    engine.accumulate(output_functional_loss(model, batch))
    sums = engine.clipped_grads()
    for param, reference in zip(params, expected):
        assert torch.allclose(sums[param].double(), reference, rtol=1e-5, atol=1e-6 * CLIP)  # sums are fp32
    engine.detach()
    assert verify_outcome(model, mode, layout) == "exact"


@pytest.mark.parametrize("mode", ["bookkeeping", "per_sample"])
def test_an_input_changed_in_place_after_the_layer_read_it_stops_the_step(mode):
    model = Tiny(input_changed_after_the_layer)
    engine, _ = make_engine(model, mode)
    batch = synthetic_token_batch(model)(3, 5, torch.Generator().manual_seed(1))
    with pytest.raises(UserError, match=r"Layer 'fc' \(Linear\).*input is modified in place"):
        engine.accumulate(output_functional_loss(model, batch))
    assert not engine.clipped_grads()  # (ghost mode and the probe's reference: autograd itself raises here)


def test_the_probe_refuses_in_one_sentence_when_its_own_reference_fails():
    """An input changed in place after a layer read it makes plain autograd raise in the probe's reference pass
    (in fp64 and again in the model's dtype): a refusal, not a traceback."""
    outcome = verify_outcome(Tiny(input_changed_after_the_layer), "bookkeeping")
    assert outcome.startswith("The start-up probe's reference") and "fix the model's forward" in outcome


def test_longformer_passes_the_probe_in_its_own_dtype():
    """Longformer's fp32 softmax mask makes plain autograd non-finite in fp64; the probe retries in fp32."""
    from arch_cases import ARCHS, build  # tests/ helper: the matrix's tiny configs

    model = build(next(a for a in ARCHS if a.name == "longformer")).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = PrivacyEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=CLIP, expected_batch_size=4,
                           dataset_size=100, verify=False)
    report = engine.verify()
    assert any("model's dtype" in note for note in report.notes)
    assert all(row.status in ("exact", "not reached") for row in report.rows.values())


def test_a_view_output_changed_in_place_is_refused_in_per_sample():
    model = Tiny(sliced_output_scaled, extra=SlicedProjection())
    model.fc.requires_grad_(False)
    engine, _ = make_engine(model, "per_sample")
    batch = synthetic_token_batch(model)(3, 5, torch.Generator().manual_seed(1))
    with pytest.raises(UserError, match=r"Layer 'extra' \(SlicedProjection\).*view.*in place"):
        engine.accumulate(output_functional_loss(model, batch))
    engine.detach()
    assert "'extra'" in verify_outcome(model, "per_sample")


@pytest.mark.parametrize("mode,layout", CASES)
def test_plain_and_keyword_calls_are_exact(mode, layout):
    assert verify_outcome(Tiny(), mode, layout) == "exact"
    assert verify_outcome(Tiny(keyword_input), mode, layout) == "exact"


@pytest.mark.parametrize("mode,layout", CASES)
def test_weight_shared_by_two_modules_is_exact_or_refused(mode, layout):
    model = Tiny(shared_weight, extra=nn.Linear(WIDTH, WIDTH, bias=False))
    model.extra.weight = model.fc.weight
    outcome = verify_outcome(model, mode, layout)
    assert outcome == "exact" or "'fc'" in outcome or "'extra'" in outcome


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
def test_linear_followed_by_inplace_relu_in_a_sequential_passes_the_probe(mode):
    # The issue asked for this layer to be caught; it is exact instead (see the in-place tests above).
    model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.ReLU(inplace=True),
                          nn.Linear(WIDTH, 3))
    engine, _ = make_engine(model, mode)
    batch = synthetic_token_batch(model[0])
    report = engine.verify(make_batch=lambda b, t, g: {"input_ids": batch(b, t, g)["input_ids"]},
                           loss_fn=lambda m, x: m(x["input_ids"]).sum(dim=(1, 2)))
    assert engine.verified and report is not None


# ---------------------------------------------------------------- issue 23: the optimizer owns the parameter set

def one_step(engine, model, rows=4):
    batch = synthetic_token_batch(model)(rows, 5, torch.Generator().manual_seed(1))
    engine.step(output_functional_loss(model, batch))


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
def test_a_layer_unfrozen_later_stops_the_step_until_replan(mode):
    model = Tiny()
    model.fc.requires_grad_(False)
    engine, optimizer = make_engine(model, mode)
    model.fc.requires_grad_(True)
    optimizer.add_param_group({"params": list(model.fc.parameters())})
    before = model.fc.weight.detach().clone()
    with pytest.raises(UserError, match=r"'fc\.weight'.*replan"):
        one_step(engine, model)
    assert torch.equal(model.fc.weight, before)  # stopped before the update
    engine.replan()
    assert engine.verified
    one_step(engine, model)
    assert not torch.equal(model.fc.weight, before)


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
def test_a_replaced_head_or_foreign_param_group_never_gets_a_raw_gradient(mode):
    model = Tiny()
    engine, optimizer = make_engine(model, mode)
    model.fc.requires_grad_(False)  # the old head leaves training (it stays in the optimizer's group)
    model.fc = nn.Linear(WIDTH, WIDTH).double()
    optimizer.add_param_group({"params": list(model.fc.parameters())})
    with pytest.raises(UserError, match="replan"):
        one_step(engine, model)
    stray = nn.Parameter(torch.ones(2, dtype=torch.float64), requires_grad=False)
    stray.grad = torch.ones(2, dtype=torch.float64)
    engine.replan()
    optimizer.add_param_group({"params": [stray]})
    with pytest.raises(UserError, match="raw gradient"):
        one_step(engine, model)
    assert torch.equal(stray, torch.ones(2, dtype=torch.float64))


# ---------------------------------------------------------------- the per-step invariant

class ScaledLinearRule:
    """A deliberately wrong rule: its clipped sums are 50× too large (an engine bug to be caught)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def clipped_sum(self, *args):
        return {k: 50 * v for k, v in self.inner.clipped_sum(*args).items()}


class HalvedSumRule(ScaledLinearRule):
    """Wrong sums within every bound (half the true clipped sum): only the probe's comparison can catch it."""

    def clipped_sum(self, *args):
        return {k: 0.5 * v for k, v in self.inner.clipped_sum(*args).items()}


class QuadrupledNormRule(ScaledLinearRule):
    """Wrong per-example norms (4× the squared norm, so over-clipping): caught as a norm, before the sums."""

    def clipped_sum(self, *args):
        return self.inner.clipped_sum(*args)

    def norm_sq(self, *args):
        return {k: 4 * v for k, v in self.inner.norm_sq(*args).items()}


@pytest.mark.parametrize("layout", ["all_layer", "per_layer"])
@pytest.mark.parametrize("wrong, words", [(HalvedSumRule, "its clipped sums differ"),
                                          (QuadrupledNormRule, "its per-example gradient norms differ")])
def test_the_probe_compares_norms_and_clipped_sums_with_brute_force(layout, wrong, words):
    model = Tiny()
    engine, _ = make_engine(model, "bookkeeping", layout)
    rule, names = engine.tracked[model.fc]
    engine.tracked[model.fc] = (wrong(rule), names)
    engine.recorder.tracked = engine.tracked
    with pytest.raises(UserError, match=f"'fc'.*{words}"):
        engine.verify()


@pytest.mark.parametrize("layout", ["all_layer", "per_layer"])
def test_the_per_step_invariant_stops_a_wrong_clipped_sum_and_writes_nothing(layout):
    model = Tiny()
    engine, _ = make_engine(model, "bookkeeping", layout)
    rule, names = engine.tracked[model.fc]
    engine.tracked[model.fc] = (ScaledLinearRule(rule), names)
    engine.recorder.tracked = engine.tracked
    batch = synthetic_token_batch(model)(4, 5, torch.Generator().manual_seed(1))
    where = "at parameter 'fc\\.weight'" if layout == "per_layer" else "for the model as a whole"
    with pytest.raises(UserError, match=f"per-step privacy check failed {where}") as error:
        engine.accumulate(output_functional_loss(model, batch))
    assert not engine.clipped_grads()
    assert "tensor(" not in str(error.value)  # never values from the batch


def test_the_probe_raises_a_broken_invariant_at_once_even_where_ranks_would_defer_it():
    """With several processes a failed per-step check waits for the step (DPOptimizer.refuse); the probe's synthetic
    batches are the same on every rank, so there it raises at once, naming the invariant, not a later symptom."""
    model = Tiny()
    engine, _ = make_engine(model, "bookkeeping")
    engine.dp_optimizer.any_rank = lambda flag, device: flag  # as a multi-process engine has (one rank alone here)
    rule, names = engine.tracked[model.fc]
    engine.tracked[model.fc] = (ScaledLinearRule(rule), names)
    engine.recorder.tracked = engine.tracked
    with pytest.raises(UserError, match="per-step privacy check failed"):
        engine.verify()
    batch = synthetic_token_batch(model)(4, 5, torch.Generator().manual_seed(1))
    engine.accumulate(output_functional_loss(model, batch))  # training: deferred to the step, dropped meanwhile
    assert not engine.clipped_grads()
    engine.zero_grad()
    with pytest.raises(UserError, match="per-step privacy check failed"):
        engine.step()


def test_non_finite_per_example_norms_stop_the_step():
    model = Tiny()
    engine, _ = make_engine(model, "bookkeeping")
    batch = synthetic_token_batch(model)(3, 5, torch.Generator().manual_seed(1))
    loss = output_functional_loss(model, batch) * torch.tensor([1.0, float("inf"), 1.0], dtype=torch.float64)
    with pytest.raises(UserError, match="not finite"):
        engine.accumulate(loss)
    assert not engine.clipped_grads()


# ---------------------------------------------------------------- the per-example loss

def scalar_broadcast_loss(model, batch):
    return output_functional_loss(model, batch).sum().expand(batch["input_ids"].shape[0])


def in_batch_negatives_loss(model, batch):
    pooled = model(**batch).mean(dim=1)
    scores = pooled @ pooled.t()
    return -torch.log_softmax(scores, dim=1).diagonal()


@pytest.mark.parametrize("mode,layout", CASES)
@pytest.mark.parametrize("loss_fn", [scalar_broadcast_loss, in_batch_negatives_loss])
def test_losses_where_examples_interact_are_refused(loss_fn, mode, layout):
    engine, _ = make_engine(Tiny(), mode, layout)
    with pytest.raises(UserError, match="refused the loss: changing one example"):
        engine.verify(loss_fn=loss_fn)


def test_a_loss_with_the_wrong_shape_is_refused():
    engine, _ = make_engine(Tiny(), "bookkeeping")
    with pytest.raises(UserError, match="one loss per example"):
        engine.verify(loss_fn=lambda m, b: output_functional_loss(m, b)[:, None])


def test_batch_statistics_in_the_model_are_refused():
    def batch_mean(h, m):
        return m.fc(h - h.mean(dim=0, keepdim=True))

    assert "changing one example" in verify_outcome(Tiny(batch_mean), "bookkeeping")


# ---------------------------------------------------------------- hooks, subclasses, expansions, experts

@pytest.mark.parametrize("mode,layout", CASES)
def test_a_foreign_hook_that_rewrites_the_output_is_exact_after_the_probe(mode, layout):
    model = Tiny()
    model.fc.register_forward_hook(lambda m, a, out: 3.0 * out)
    engine, _ = make_engine(model, mode, layout)
    batch = synthetic_token_batch(model)(3, 5, torch.Generator().manual_seed(1))
    with pytest.raises(UserError, match=r"'fc'.*needs the start-up probe"):
        engine.accumulate(output_functional_loss(model, batch))
    engine.detach()
    assert verify_outcome(model, mode, layout) == "exact"


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
def test_hooks_added_after_the_plan_stop_the_step(mode):
    model = Tiny()
    engine, _ = make_engine(model, mode)
    model.fc.register_forward_hook(lambda m, a, out: out.tanh(), prepend=True)
    batch = synthetic_token_batch(model)(3, 5, torch.Generator().manual_seed(1))
    with pytest.raises(UserError, match=r"hooks of layer 'fc' changed.*replan"):
        engine.accumulate(output_functional_loss(model, batch))


class GatedNorm(nn.Module):
    """RMSNorm-shaped (one weight, eps) but its forward takes a gate: only the structure matches."""

    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = 1e-6

    def forward(self, x, gate=None):
        y = self.weight * x * (x.pow(2).mean(-1, keepdim=True) + self.eps).rsqrt()
        return y if gate is None else y * torch.sigmoid(gate)


@pytest.mark.parametrize("mode,layout", CASES)
def test_a_structural_match_called_with_an_extra_input_is_refused_or_exact(mode, layout):
    model = Tiny(lambda h, m: m.extra(m.fc(h), gate=h), extra=GatedNorm(WIDTH))
    engine, _ = make_engine(model, mode, layout)
    batch = synthetic_token_batch(model)(3, 5, torch.Generator().manual_seed(1))
    if mode != "per_sample":
        with pytest.raises(UserError, match=r"'extra'.*called with 2 inputs"):
            engine.accumulate(output_functional_loss(model, batch))
    engine.detach()
    outcome = verify_outcome(model, mode, layout)
    assert outcome == "exact" or "'extra'" in outcome


def test_an_expert_fed_exactly_b_rows_of_other_examples_tokens_is_refused():
    def expert(h, m):  # the router sends the first B tokens of the flattened batch: B rows, not B examples
        flat = h.reshape(-1, h.shape[-1])
        chosen = torch.arange(h.shape[0])
        routed = torch.zeros_like(flat).index_add(0, chosen, m.fc(flat[chosen]))
        return routed.reshape(h.shape)

    def capacity_router(h, m):  # top-B tokens by score: routing makes examples interact
        flat = h.reshape(-1, h.shape[-1])
        chosen = flat[:, 0].topk(h.shape[0]).indices
        routed = torch.zeros_like(flat).index_add(0, chosen, m.fc(flat[chosen]))
        return routed.reshape(h.shape)

    for mode, layout in CASES:
        assert "'fc'" in verify_outcome(Tiny(expert), mode, layout)
        outcome = verify_outcome(Tiny(capacity_router), mode, layout)
        # which check stops it depends on the random weights: the layer's rows, the loss's independence, or (ghost)
        # the all-layer invariant, whose budget is the whole model's and so names no layer
        assert "'fc'" in outcome or "examples interact" in outcome or "failed for the model as a whole" in outcome


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
def test_a_shared_batch_one_prompt_is_exact_or_refused(mode):
    class Prompted(Tiny):
        def __init__(self, repeat):
            super().__init__()
            self.prompt = nn.Embedding(3, WIDTH)
            self.repeat = repeat

        def forward(self, input_ids, attention_mask=None):
            prompt = self.prompt(torch.arange(3)[None])  # batch 1, broadcast below
            b = input_ids.shape[0]
            prompt = prompt.repeat(b, 1, 1) if self.repeat else prompt.expand(b, -1, -1)
            return self.fc(torch.cat([prompt, self.embed(input_ids)], dim=1))[:, 3:]

    assert verify_outcome(Prompted(repeat=False), mode) == "exact"
    assert "'prompt'" in verify_outcome(Prompted(repeat=True), mode)


# ---------------------------------------------------------------- per_sample's torch.func fallback

class MaskedMix(nn.Module):
    """No rule: mixes positions with a (T, T) mask passed as a keyword."""

    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) * 0.3)

    def forward(self, x, mask=None):
        return torch.einsum("st,btd->bsd", mask, x @ self.weight)


@pytest.mark.parametrize("layout", ["all_layer", "per_layer"])
def test_functional_fallback_keeps_keyword_masks_and_does_not_split_them(layout):
    def body(h, m):
        positions = h.shape[1]
        return m.extra(m.fc(h), mask=torch.tril(torch.ones(positions, positions, dtype=h.dtype)))

    model = Tiny(body, extra=MaskedMix(WIDTH))
    assert verify_outcome(model, "per_sample", layout) == "exact"


def causal_mix_by_keyword(h, m):
    positions = h.shape[1]
    return m.extra(m.fc(h), mask=torch.tril(torch.ones(positions, positions, dtype=h.dtype)))


def causal_mix_by_position(h, m):
    positions = h.shape[1]
    return m.extra(m.fc(h), torch.tril(torch.ones(positions, positions, dtype=h.dtype)))


def engine_matches_brute_force(model, engine, batch, layout="all_layer"):
    params = [p for p in model.parameters()]
    engine.accumulate(output_functional_loss(model, batch))
    sums = engine.clipped_grads()
    engine.zero_grad()
    was = [p.requires_grad for p in params]
    for param in params:  # the reference differentiates every parameter (book-keeping/per_sample froze them)
        param.requires_grad_(True)
    with engine.recorder.paused():
        expected = brute_force_clipped_sum(model, batch, params, layout)
    for param, flag in zip(params, was):
        param.requires_grad_(flag)
    return all(torch.allclose(sums[p].double(), e, rtol=1e-5, atol=1e-6 * CLIP) for p, e in zip(params, expected))


@pytest.mark.parametrize("body", [causal_mix_by_keyword, causal_mix_by_position])
def test_functional_fallback_without_the_probe_refuses_a_call_whose_batch_dimension_is_unproven(body):
    # B = T = 4: the (T, T) mask starts with the batch size, so its shape cannot say whether it is per example.
    model = Tiny(body, extra=MaskedMix(WIDTH))
    engine, _ = make_engine(model, "per_sample")
    batch = synthetic_token_batch(model)(4, 4, torch.Generator().manual_seed(1))
    with pytest.raises(UserError, match=r"MaskedMix is called with a batch of 4 .*cannot be proven.*probe"):
        engine.accumulate(output_functional_loss(model, batch))
    assert not engine.clipped_grads()


@pytest.mark.parametrize("body", [causal_mix_by_keyword, causal_mix_by_position])
def test_functional_fallback_without_the_probe_learns_the_layout_where_shapes_prove_it(body):
    model = Tiny(body, extra=MaskedMix(WIDTH)).double()
    engine, _ = make_engine(model, "per_sample")
    generator = torch.Generator().manual_seed(1)
    # B ≠ T proves that the mask is shared; the later B = T batch must not split it, and B = 1 needs no proof
    for rows, length in ((3, 5), (4, 4), (1, 3)):
        assert engine_matches_brute_force(model, engine, synthetic_token_batch(model)(rows, length, generator))


def test_functional_fallback_refuses_an_input_that_was_shared_and_now_carries_the_batch():
    def body(h, m):
        rows = h.shape[0] if h.shape[0] == 3 else 1  # (1, T, T) for the first batch, (B, T, T) afterwards
        positions = h.shape[1]
        mask = torch.tril(torch.ones(positions, positions, dtype=h.dtype))
        return m.extra(m.fc(h), mask=mask.expand(rows, -1, -1) if rows > 1 else mask[None])

    class BatchedMaskMix(MaskedMix):
        def forward(self, x, mask=None):
            return torch.einsum("bst,btd->bsd", mask.expand(x.shape[0], -1, -1), x @ self.weight)

    model = Tiny(body, extra=BatchedMaskMix(WIDTH))
    engine, _ = make_engine(model, "per_sample")
    generator = torch.Generator().manual_seed(1)
    engine.accumulate(output_functional_loss(model, synthetic_token_batch(model)(2, 5, generator)))
    engine.zero_grad()
    with pytest.raises(UserError, match=r"'mask' now carries the batch where it was shared"):
        engine.accumulate(output_functional_loss(model, synthetic_token_batch(model)(3, 5, generator)))


# ---------------------------------------------------------------- random stacks: exact or refused, never wrong

OPS = ["linear", "relu_inplace", "mul_inplace", "functional_embed", "reuse_fc", "tanh"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=4),
       mode_layout=st.sampled_from(CASES))
def test_random_layer_stacks_are_exact_or_refused(ops, mode_layout):
    def body(h, m):
        for op in ops:
            if op == "linear":
                h = m.extra(h)
            elif op == "relu_inplace":
                h = F.relu(m.fc(h), inplace=True)
            elif op == "mul_inplace":
                h = m.fc(h).mul_(0.5)
            elif op == "functional_embed":
                h = F.linear(h, m.embed.weight) @ m.embed.weight
            elif op == "reuse_fc":
                h = m.fc(m.fc(h))
            else:
                h = torch.tanh(h)
        return h

    torch.manual_seed(len(ops))
    outcome = verify_outcome(Tiny(body, extra=nn.Linear(WIDTH, WIDTH)), *mode_layout)
    # verify_outcome checks the remove-one-example sensitivity whenever the probe accepts the model
    if outcome != "exact":
        assert "layer '" in outcome


# ---------------------------------------------------------------- dptext check --model

def test_check_model_prints_a_per_layer_table_as_json(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["check", "--model", "tiny-llama", "--clipping-mode", "ghost", "--json"])
    assert exit_info.value.code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["verdict"] == "exact" and result["clipping_mode"] == "ghost"
    layers = {row["name"]: row for row in result["layers"]}
    assert layers["model.embed_tokens"]["rule"] == "Embedding"
    assert all(row["status"] in ("exact", "not reached") for row in layers.values())


def test_check_model_reports_a_planning_refusal_as_the_verdict():
    result = check_model("tiny-gpt2", clipping_mode="ghost", clipping_layout="per_layer")
    assert result["verdict"] == "refused" and "per-layer" in result["why"]


def test_peft_lora_on_embeddings_is_exact_in_per_sample_and_refused_by_name_elsewhere():
    peft = pytest.importorskip("peft")
    for mode in ("per_sample", "bookkeeping"):
        base, _ = load_model("tiny-gpt2", head="causal_lm")
        config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["wte", "c_attn"], lora_dropout=0.0)
        model = peft.get_peft_model(base, config)
        model.train()
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        if mode == "bookkeeping":
            with pytest.raises(UserError, match=r"'base_model\.model\.transformer\.wte\.lora_embedding_A'"):
                PrivacyEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=0.1, expected_batch_size=2,
                              dataset_size=10, clipping_mode=mode, verify=False)
            continue
        engine = PrivacyEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=0.1, expected_batch_size=2,
                               dataset_size=10, clipping_mode=mode, verify=False)
        rows = {row.name: row.status for row in engine.verify().rows.values()}
        assert rows["base_model.model.transformer.wte"] == "exact"
