"""Book-keeping with layers under the ghost treatment (issue 42, "Long sequences"): the memory rule chosen at plan
time, and the hybrid step against brute-force per-example autograd, the remove-one-example test, the start-up probe
(with a broken hybrid as the mutant it must refuse) and the fail-closed checks around its second backward pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptext.errors import UserError
from dptext.models import load_model
from dptext.privacy import PrivacyEngine
from dptext.privacy.clipping import hybrid
from dptext.privacy.clipping.long_sequences import ghost_treated, stored_bytes
from dptext.privacy.norms import outer
from dptext.privacy.norms.outer import OuterForm, inner_product, left_gram
from dptext.privacy.proof.synthetic import output_functional_loss, synthetic_token_batch
from test_privacy_engine import MODELS, check_against_brute_force, masked_batch
from test_privacy_failclosed import (Tiny, add_to_output_slice, assert_sensitivity, brute_force_clipped_sum,
                                     make_engine, mul_inplace, relu_inplace)

ALL_GHOST = {"max_stored_bytes": 0, "sequence_length": 1}  # every eligible layer over the rule


@pytest.mark.parametrize("name,head", MODELS)
@pytest.mark.parametrize("shape", [(4, 12), (5, 5)])  # B ≠ T, and B = T
def test_the_hybrid_matches_brute_force_on_padded_tied_models(name, head, shape):
    model, _ = load_model(name, head=head)
    engine = check_against_brute_force(model, masked_batch(head, *shape), "bookkeeping", batch_size=shape[0],
                                       **ALL_GHOST)
    ghost = {engine.names[m] for m in engine.ghost_modules}
    assert len(ghost) >= 6 and not any("word" in n or "wte" in n or "embed_tokens" in n for n in ghost)  # tied


def test_ghost_treated_layers_release_their_records_in_the_hook(monkeypatch):
    model, _ = load_model("tiny-llama", head="causal_lm")
    engine = make_engine(model, "bookkeeping", **ALL_GHOST)[0]
    seen = {}
    real = hybrid.checked_uses

    def spy(engine_, loss):
        uses = real(engine_, loss)
        seen["early"] = [u for u in uses if u.norm_sq is not None]
        seen["held"] = [u for u in uses if u.grad_output is not None]
        return uses

    monkeypatch.setattr(hybrid, "checked_uses", spy)
    batch = masked_batch("causal_lm")
    engine.accumulate(output_functional_loss(model, {k: batch[k] for k in ("input_ids", "attention_mask")}))
    early = {u.module for u in seen["early"]}
    assert early == set(engine.ghost_modules)  # each called once: norm in its hook, records gone
    assert all(u.released and u.grad_output is None and u.activation is None for u in seen["early"])
    assert {u.module for u in seen["held"]}.isdisjoint(early)


def test_the_rule_counts_bytes_from_shapes_and_leaves_the_default_alone():
    model, _ = load_model("tiny-gpt2", head="causal_lm")
    plain = make_engine(model, "bookkeeping")[0]
    assert not plain.ghost_modules and not any(p.requires_grad for p in plain.params)  # today's book-keeping
    plain.detach()
    c_fc = model.transformer.h[0].mlp.c_fc  # Conv1D (in 32, out 128) of the tiny GPT-2
    rule = plain.tracked[c_fc][0]
    per_example = stored_bytes(c_fc, rule, ("weight",), 100)
    assert per_example == 100 * sum(c_fc.weight.shape) * 8  # fp64 (make_engine doubles the model)
    chosen = ghost_treated(plain.tracked, per_example - 1, 100)
    assert c_fc in chosen and model.transformer.h[0].attn.c_proj not in chosen  # 32 + 32 < 32 + 128
    assert not ghost_treated(plain.tracked, per_example, 100).get(c_fc)
    engine = make_engine(model, "bookkeeping", max_stored_bytes=per_example - 1, sequence_length=100)[0]
    assert c_fc in engine.ghost_modules and c_fc.weight.requires_grad  # pass 2 is autograd's
    assert not model.transformer.h[0].attn.c_proj.weight.requires_grad


def test_a_ghost_treated_layer_called_twice_keeps_its_cross_term():
    torch.manual_seed(1)
    model = Tiny(lambda h, m: m.fc(torch.tanh(m.fc(h)))).double()
    batch = synthetic_token_batch(model)(5, 7, torch.Generator().manual_seed(5))
    params = list(model.parameters())
    expected = brute_force_clipped_sum(model, batch, params, "all_layer")
    engine, _ = make_engine(model, "bookkeeping", **ALL_GHOST)
    assert model.fc in engine.ghost_modules
    engine.accumulate(output_functional_loss(model, batch))
    sums = engine.clipped_grads()
    for param, reference in zip(params, expected):
        assert torch.allclose(sums[param].double(), reference, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("body", [None, relu_inplace, mul_inplace, add_to_output_slice])
def test_the_hybrid_is_proven_by_the_probe_and_moves_at_most_c(body):
    torch.manual_seed(3)
    engine, _ = make_engine(Tiny(body), "bookkeeping", **ALL_GHOST)
    assert engine.ghost_modules
    engine.verify()
    assert_sensitivity(engine, synthetic_token_batch(engine.model)(5, 7, torch.Generator().manual_seed(5)))


def test_the_probe_refuses_a_broken_hybrid(monkeypatch):
    """The mutant: pass 2 weighted by the clipping factors plus a little (a wrong clipped sum for the ghost-treated
    layers only). The probe runs the engine's own accumulate, so it must see it."""
    real = hybrid._second_pass
    monkeypatch.setattr(hybrid, "_second_pass",
                        lambda loss, params: {p: g * 1.01 for p, g in real(loss, params).items()})
    torch.manual_seed(3)
    engine = make_engine(Tiny(), "bookkeeping", **ALL_GHOST)[0]
    with pytest.raises(UserError, match="probe refused layer .*clipped sums differ"):
        engine.verify()
    engine.detach()
    monkeypatch.setattr(hybrid, "_second_pass", real)
    make_engine(Tiny(), "bookkeeping", **ALL_GHOST)[0].verify()  # restored: proven


def test_a_foreign_backward_and_a_direct_step_are_refused_around_the_second_pass():
    model = Tiny().double()
    engine, optimizer = make_engine(model, "bookkeeping", **ALL_GHOST)
    batch = synthetic_token_batch(model)(3, 5, torch.Generator().manual_seed(1))
    output_functional_loss(model, batch).sum().backward()  # the user's own backward reaches the hooks
    with pytest.raises(UserError, match="backward pass the privacy engine did not issue"):
        engine.accumulate(output_functional_loss(model, batch))
    engine.zero_grad()
    output_functional_loss(model, batch).sum().backward()  # fc is in autograd: it has a raw .grad now
    with pytest.raises(UserError, match="stepped directly"):
        optimizer.step()
    model.zero_grad()
    engine.zero_grad()
    engine.step(output_functional_loss(model, batch))  # the engine's own step still works


def test_a_ghost_treated_layer_frozen_after_the_plan_is_refused_and_stays_frozen():
    model = Tiny().double()
    engine, _ = make_engine(model, "bookkeeping", **ALL_GHOST)
    model.fc.weight.requires_grad_(False)
    batch = synthetic_token_batch(model)(3, 5, torch.Generator().manual_seed(1))
    with pytest.raises(UserError, match="frozen after the privacy engine planned"):
        engine.step(output_functional_loss(model, batch))
    engine.detach()
    assert not model.fc.weight.requires_grad and model.fc.bias.requires_grad and model.embed.weight.requires_grad


def test_a_ghost_treated_weight_read_outside_its_layer_is_refused():
    model = Tiny(lambda h, m: m.fc(h) + F.linear(h, m.fc.weight)).double()
    engine, _ = make_engine(model, "bookkeeping", **ALL_GHOST)
    batch = synthetic_token_batch(model)(3, 5, torch.Generator().manual_seed(1))
    with pytest.raises(UserError, match="Parameter 'fc.weight' is read outside"):
        engine.accumulate(output_functional_loss(model, batch))
    assert not engine.clipped_grads()


@pytest.mark.parametrize("settings,match", [
    ({"max_stored_bytes": 10}, "together with sequence_length"),
    ({"max_stored_bytes": 10, "sequence_length": 8, "clipping_mode": "ghost"}, "clipping_mode='bookkeeping'"),
    ({"max_stored_bytes": 10, "sequence_length": 8, "clipping_layout": "per_layer"}, "all_layer"),
])
def test_settings_the_hybrid_cannot_serve_are_refused(settings, match):
    model = Tiny().double()
    with pytest.raises(UserError, match=match):
        PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.0, max_grad_norm=1.0,
                      expected_batch_size=4, dataset_size=100, verify=False, **settings)


def test_units_keep_their_records_and_stay_exact():
    """User-level units: norms need rows of a unit together, so ghost-treated layers keep their records in pass 1
    and still take their clipped sums from pass 2 (weighted per unit)."""
    model = Tiny().double()
    batch = synthetic_token_batch(model)(4, 5, torch.Generator().manual_seed(2))
    units = torch.tensor([0, 1, 0, 2])
    reference = make_engine(model, "bookkeeping")[0]  # plain book-keeping, itself checked against users' autograd
    reference.max_examples_per_user = 2  # user-level, as engine.user_sampler() makes it: accumulate takes units then
    reference.accumulate(output_functional_loss(model, batch), units=units)
    expected = {p: s.clone() for p, s in reference.clipped_grads().items()}
    reference.detach()
    engine = make_engine(model, "bookkeeping", **ALL_GHOST)[0]
    engine.max_examples_per_user = 2
    engine.accumulate(output_functional_loss(model, batch), units=units)
    for param, value in engine.clipped_grads().items():
        assert torch.allclose(value.double(), expected[param].double(), rtol=1e-6, atol=1e-9)


def test_an_empty_module_list_is_plain_bookkeeping():
    assert ghost_treated({nn.Linear(2, 2): (object(), ("weight",))}, None, None) == {}


def test_dptext_check_prints_the_rule_and_the_default_is_unchanged(tmp_path, capsys):
    from test_check_plan import QUICKSTART, TINY, check_plan, own_data

    recipe = [str(QUICKSTART), *TINY, f"data.path={own_data(tmp_path)}"]
    assert check_plan(recipe, capsys)["clipping"].startswith("book-keeping (all_layer): one backward pass")
    hybrid_plan = check_plan([*recipe, "privacy.max_stored_bytes=1048576", "data.max_length=1024"],
                             capsys)["clipping"]
    assert "width exceeds 256" in hybrid_plan and "T = 1024" in hybrid_plan


@pytest.mark.slow
@pytest.mark.parametrize("name,head", MODELS[:3])
def test_the_probe_proves_the_hybrid_on_tied_transformers(name, head):
    model, _ = load_model(name, head=head)
    engine = make_engine(model, "bookkeeping", **ALL_GHOST)[0]
    assert engine.ghost_modules
    engine.verify()
    assert engine.verified


def _brute_outer(form: OuterForm, vocab: int) -> torch.Tensor:
    if not form.left_is_ids:
        return torch.einsum("btm,btn->bmn", form.left.double(), form.right.double())
    grad = torch.zeros(form.left.shape[0], vocab, form.right.shape[2], dtype=torch.float64)
    for b, t in (form.left >= 0).nonzero().tolist():
        grad[b, form.left[b, t]] += form.right[b, t].double()
    return grad


def test_the_tied_cross_term_is_instantiated_where_that_is_smaller_and_stays_exact():
    """At long T the Gram form of ⟨G_emb, G_head⟩ holds (B, T, T) matrices; where V·d < 2T² the head's gradient
    is formed instead (SPEC §2's mixed rule). Padding ids (< 0) contribute nothing."""
    generator = torch.Generator().manual_seed(0)
    batch, length, vocab, width = 3, 20, 7, 5
    emb = OuterForm(torch.randint(-1, vocab, (batch, length), generator=generator),
                    torch.randn(batch, length, width, generator=generator))
    head = OuterForm(torch.randn(batch, length, vocab, generator=generator),
                     torch.randn(batch, length, width, generator=generator))
    for u, v in ((emb, head), (head, emb), (head, head)):
        expected = (_brute_outer(u, vocab) * _brute_outer(v, vocab)).sum(dim=(1, 2))
        gram = (left_gram(u, v) * torch.bmm(u.right.float(), v.right.float().transpose(1, 2))).sum(dim=(1, 2))
        got = inner_product(u, v)
        assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5)
        assert torch.allclose(gram.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_tied_models_at_a_length_where_the_cross_term_is_instantiated_match_brute_force(name, monkeypatch):
    calls = []
    real = outer._instantiated
    monkeypatch.setattr(outer, "_instantiated", lambda u, v: calls.append(1) or real(u, v))
    model, _ = load_model(name, head="causal_lm")  # V·d = 261·32 < 2·72²
    check_against_brute_force(model, masked_batch("causal_lm", 3, 72), "bookkeeping", batch_size=3)
    assert calls
