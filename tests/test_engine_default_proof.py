"""The library fails closed by default (issue 43): a ``PrivacyEngine`` proves its clipping before the first
training forward unless told not to (and then says so), and the step refuses what the engine did not issue —
another backward pass, a direct optimizer step, a parameter replaced or a global hook added after the plan, a
privacy setting changed after construction. Through the public API, on tiny models built in code.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_module

from dptext.errors import UserError
from dptext.models import load_model
from dptext.privacy import PrivacyEngine, causal_lm_loss
from dptext.privacy.proof.verify import probe
from dptext.privacy.proof.synthetic import output_functional_loss


def tiny_llama():
    model = load_model("tiny-llama", head="causal_lm")[0]
    model.train()
    return model


def engine_for(model, mode="bookkeeping", **options):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    settings = dict(noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=2, dataset_size=100,
                    clipping_mode=mode)
    return PrivacyEngine(model, optimizer, **{**settings, **options}), optimizer


def batch(examples=2, length=6):
    ids = torch.randint(1, 200, (examples, length), generator=torch.Generator().manual_seed(examples + length))
    return ids, torch.ones_like(ids)


def lm_loss(model, ids, mask):
    return causal_lm_loss(model(input_ids=ids, attention_mask=mask).logits, ids, mask)


class BatchCentred(nn.Module):
    """Subtracts the batch mean: every example's output depends on the others'."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(17, 8)
        self.fc = nn.Linear(8, 8)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None):
        h = self.fc(self.embed(input_ids))
        return h - h.mean(dim=0, keepdim=True)


class NoVocabulary(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(x).squeeze(-1)


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
def test_the_first_training_forward_runs_the_proof_without_an_explicit_verify(mode):
    model = tiny_llama()
    engine, _ = engine_for(model, mode)
    assert not engine.verified and engine.mechanism()["clipping_verified"] is False
    with torch.no_grad():  # evaluation forwards do not trigger it
        model(input_ids=batch()[0])
    assert not engine.verified
    engine.step(lm_loss(model, *batch()))
    assert engine.verified and engine.mechanism()["clipping_verified"] is True
    assert engine.mechanism()["clipping"].startswith("exact")


def test_a_model_the_probe_refuses_is_refused_at_the_first_forward_before_any_update():
    model = BatchCentred().double()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine, _ = engine_for(model)
    ids = torch.randint(1, 17, (3, 4))
    with pytest.raises(UserError, match="start-up probe"):
        model(input_ids=ids)
    assert engine.steps == 0
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())


def test_a_model_it_cannot_feed_is_refused_in_one_sentence_naming_the_way_out():
    model = NoVocabulary()
    engine_for(model)
    with pytest.raises(UserError, match="probe_batch=") as caught:
        model(torch.randn(3, 4))
    assert str(caught.value).count(". ") == 0


def test_a_custom_probe_batch_and_loss_given_to_the_constructor_are_used():
    model = NoVocabulary().double()
    calls = []

    def make_batch(examples, positions, generator):
        calls.append((examples, positions))
        return {"x": torch.randn(examples, 4, generator=generator, dtype=torch.float64)}

    engine, _ = engine_for(model, probe_batch=make_batch, probe_loss=lambda m, b: m(b["x"]))
    engine.step(model(torch.randn(3, 4, dtype=torch.float64)))
    assert engine.verified and calls


def test_opting_out_is_recorded_where_epsilon_is_reported():
    model = tiny_llama()
    engine, _ = engine_for(model, verify=False)
    engine.step(lm_loss(model, *batch()))
    mechanism = engine.mechanism()
    assert mechanism["clipping_verified"] is False and "NOT VERIFIED" in mechanism["clipping"]
    assert "verify=False" in mechanism["clipping"]


def test_the_recipe_opt_out_is_a_release_flag():
    from types import SimpleNamespace

    from dptext.release import FLAG_REASONS, recipe_flags

    privacy = SimpleNamespace(enabled=True, reproducible_noise=False, verify=False, method="dp_sgd")
    flags = recipe_flags(SimpleNamespace(privacy=privacy))
    assert "clipping_not_verified" in flags and "not verified" in FLAG_REASONS["clipping_not_verified"]


@pytest.mark.parametrize("setting", ["noise_multiplier", "max_grad_norm"])
def test_privacy_settings_are_fixed_after_construction(setting):
    engine, _ = engine_for(tiny_llama(), verify=False)
    with pytest.raises(UserError, match="fixed when the privacy engine is built"):
        setattr(engine, setting, 123.0)


def test_the_noise_drawn_has_the_std_the_accounting_uses():
    """σ = 2, C = 0.5, B = 4, lr 1, an empty Poisson batch: every coordinate moves by N(0, (σC/B)²)."""
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    engine = PrivacyEngine(model, optimizer, noise_multiplier=2.0, max_grad_norm=0.5, expected_batch_size=4,
                           dataset_size=100, seed=1, verify=False)
    before = torch.cat([p.detach().flatten().clone() for p in engine.params])
    engine.step()
    moved = torch.cat([p.detach().flatten() for p in engine.params]) - before
    assert abs(float(moved.std()) / (2.0 * 0.5 / 4) - 1) < 0.02
    assert engine.noise_multiplier == 2.0 and engine.max_grad_norm == 0.5


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
def test_a_backward_pass_the_engine_did_not_issue_is_refused(mode):
    model = tiny_llama()
    engine, _ = engine_for(model, mode)
    engine.verify()
    ids, mask = batch()
    lm_loss(model, ids, mask).sum().backward()  # e.g. an input-saliency pass between steps
    with pytest.raises(UserError, match="did not issue"):
        engine.accumulate(lm_loss(model, ids, mask))


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
def test_stepping_the_wrapped_optimizer_directly_is_refused(mode):
    model = tiny_llama()
    engine, optimizer = engine_for(model, mode)
    engine.verify()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in engine.params:  # raw gradients, as a plain loss.backward() leaves them in ghost mode
        p.grad = torch.ones_like(p)
    with pytest.raises(UserError, match="stepped directly"):
        optimizer.step()
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())
    engine.zero_grad()
    for p in model.parameters():
        p.grad = None
    engine.step(lm_loss(model, *batch()))  # the engine's own step goes through
    assert engine.steps == 1


def test_a_parameter_replaced_after_the_plan_is_refused_at_the_step():
    model = tiny_llama()
    engine, _ = engine_for(model)
    engine.verify()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    with pytest.raises(UserError, match="no longer in the model"):
        engine.step(lm_loss(model, *batch()))


def test_a_global_module_hook_added_after_the_plan_is_refused():
    model = tiny_llama()
    engine, _ = engine_for(model)
    engine.verify()
    handle = torch_module.register_module_forward_hook(lambda module, args, output: None)
    try:
        with pytest.raises(UserError, match="global module hook"):
            engine.step(lm_loss(model, *batch()))
    finally:
        handle.remove()
    engine.zero_grad()
    engine.step(lm_loss(model, *batch()))


def test_output_functional_loss_stays_available_to_users():
    model = tiny_llama()
    ids, mask = batch()
    assert output_functional_loss(model, {"input_ids": ids, "attention_mask": mask}).shape == (2,)


def test_a_degenerate_sigma_is_answered_in_one_line_not_a_memory_error():
    """σ = 0.001 asked the PLD accountant for a 224 GiB grid; now PLD says "not computed" and RDP bounds ε."""
    from dptext.accounting import StepRun
    from dptext.accounting.epsilon import compute_all

    results = {r.method: r for r in compute_all([StepRun(1.0, 0.001, 30)], 0.01)}
    assert results["pld"].epsilon is None and "below 0.03" in results["pld"].note
    assert results["rdp"].epsilon > 1e6


def test_a_learning_rate_zero_step_with_raw_gradients_is_refused_in_ghost_mode():
    """lr 0 lets torch.distributed.checkpoint's zero-gradient step through, but with a raw gradient it would feed
    momentum that a later engine step applies (red team, issue 43)."""
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    engine = PrivacyEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=2,
                           dataset_size=100, clipping_mode="ghost", verify=False)
    with engine.recorder.paused():
        lm_loss(model, *batch()).sum().backward()
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    with pytest.raises(UserError, match="stepped directly"):
        optimizer.step()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # zero gradients at lr 0: inert, as DCP's state initialisation


def test_a_proof_is_carried_only_to_an_engine_with_the_same_layers_and_rules():
    """verify=report (a proof made before fully_shard; the two-rank case is in test_fsdp_redteam): the same
    modules and rules are taken as proven; another model or another trainable set is refused."""
    model = tiny_llama()
    first, _ = engine_for(model)
    report = first.verify()
    first.detach()
    carried, _ = engine_for(model, verify=report)
    assert carried.verified and "NOT VERIFIED" not in str(carried.mechanism())
    carried.step(lm_loss(model, *batch()))
    carried.detach()
    with pytest.raises(UserError, match="other layers or rules than this engine's plan"):
        engine_for(tiny_llama(), verify=report)
    model.model.layers[0].mlp.down_proj.requires_grad_(False)
    with pytest.raises(UserError, match="other layers or rules .*down_proj"):
        engine_for(model, verify=report)


def test_a_refused_proof_cannot_be_carried():
    model = tiny_llama()
    first, _ = engine_for(model)
    report = probe(first)
    first.detach()
    row = next(iter(report.rows.values()))
    row.status, row.why = "refused", "a test's refusal"
    with pytest.raises(UserError, match="a test's refusal"):
        engine_for(model, verify=report)
