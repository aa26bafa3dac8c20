"""Red-team tests of eDP-SGD (SPEC §4, §11): each passes on a correct implementation and failed on the code before
its fix. Tiny models built in code, no network, no data files."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dptext.accounting import NoiseSchedule, PrivacyLedger
from dptext.errors import UserError
from dptext.privacy.mechanisms.edp import EDPEngine

C = 1.0


def engine_for(**kwargs):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    settings = dict(noise_multiplier=1.0, max_grad_norm=C, sample_rate=0.5, dataset_size=10, verify=False, seed=0)
    settings.update(kwargs)
    return model, optimizer, EDPEngine(model, optimizer, **settings)


def test_a_direct_optimizer_step_with_raw_gradients_is_refused():
    """PrivacyEngine refuses a step of its optimizer outside engine.step(); EDPEngine applied the raw, unclipped,
    un-noised gradient of a plain loss.backward() (the weights moved by ~2e4 here) with nothing in the ledger."""
    model, optimizer, _ = engine_for()
    before = model.weight.detach().clone()
    model(torch.randn(3, 4) * 100).pow(2).sum().backward()
    with pytest.raises(UserError, match="stepped directly"):
        optimizer.step()
    assert torch.equal(model.weight, before)


@pytest.mark.parametrize("name, value", [("max_grad_norm", 100.0), ("noise_multiplier", 100.0), ("factor", 1)])
def test_settings_that_define_the_guarantee_are_fixed(name, value):
    """SPEC §11: σ, C (and eDP's sensitivity factor) are fixed for the life of an engine. Assigning
    engine.max_grad_norm made close_unit clip to the new C while the noise stayed σ·C_old and the ledger unchanged;
    assigning engine.factor = 1 made the ledger account z_t (sensitivity C) for a 2C mechanism."""
    _, _, engine = engine_for()
    with pytest.raises(UserError):
        setattr(engine, name, value)


def test_a_gradient_not_issued_by_the_engine_is_refused_not_folded_into_a_unit():
    """A plain backward over the whole batch left in .grad was silently added to the next micro-batch and clipped
    with it: every example then moves two units (its own and that one), 4C instead of the accounted 2C."""
    model, _, engine = engine_for(noise_multiplier=0.0)
    x = torch.randn(6, 4)
    model(x).pow(2).sum().backward()  # not through engine.accumulate
    with pytest.raises(UserError, match="not issued by the engine"):
        engine.accumulate(model(x[:1]).pow(2).sum(1))


@pytest.mark.parametrize("between", ["chunks", "last_chunk_and_close"])
def test_a_backward_between_the_chunks_of_a_micro_batch_is_refused(between):
    """Only the start of a micro-batch was checked: a plain backward over other examples between its chunks (or after
    its last, before close_unit) joined its clip unseen, so those examples moved two units, 4C where 2C is
    accounted. Now .grad must be as the engine's own backward left it (the tensor and its version counter)."""
    model, _, engine = engine_for(noise_multiplier=0.0)
    x = torch.randn(6, 4)
    engine.accumulate(model(x[:2]).pow(2).sum(1))  # the unit's first chunk
    model(x[2:]).pow(2).sum().backward()  # other examples, not through engine.accumulate
    with pytest.raises(UserError, match="not issued by the engine"):
        if between == "chunks":
            engine.accumulate(model(x[:1]).pow(2).sum(1))
        else:
            engine.close_unit()
    assert all(param.grad is None for param in model.parameters()) and engine.clipped_grads() == {}


def test_chunks_of_one_micro_batch_add_up_as_one():
    """The check lets the engine's own chunks through: two chunks clip as the whole micro-batch does."""
    x = torch.randn(6, 4)
    norms = []
    for chunks in ([x[:3], x[3:]], [x]):
        model, _, engine = engine_for(noise_multiplier=0.0)
        for chunk in chunks:
            engine.accumulate(model(chunk).pow(2).sum(1))
        norms.append(engine.close_unit())
        sums = engine.clipped_grads()
    assert norms[0] == pytest.approx(norms[1]) and all(torch.isfinite(g).all() for g in sums.values())


def test_a_decaying_schedule_is_refused_before_its_noise_falls_below_the_floor():
    """z_0 was checked against the floor, z_t never: exp:800 underflowed to σ_t = 0 at the second epoch, whose
    step was applied with NO noise before the ledger refused σ = 0 (the update stayed in the model); exp:30 ran at
    σ_t = 5e-14 (ε = 3e52 by RDP, none at all by PRV/PLD). Refused when the sampler is planned, before any step."""
    ledger = PrivacyLedger(delta=1e-5, accountant="rdp")
    model, _, engine = engine_for(schedule=NoiseSchedule("exp", rate=800.0), steps_per_epoch=1, ledger=ledger)
    with pytest.raises(UserError, match="below"):
        engine.sampler(3)
    engine.step()  # epoch 0: σ_0 = 0.5, fine
    before = model.weight.detach().clone()
    with pytest.raises(UserError, match="below"):
        engine.step()  # epoch 1: σ_1 underflows; refused before the update
    assert torch.equal(model.weight, before)
    assert ledger.steps == 1
    _, _, fine = engine_for(schedule=NoiseSchedule("linear", rate=0.5), steps_per_epoch=2)
    fine.sampler(20)  # a schedule that stays above the floor is accepted


@pytest.mark.parametrize("alpha", [0.0, -1.0, math.nan, math.inf])
def test_a_scaling_that_is_not_positive_and_finite_is_refused(alpha):
    model = nn.Linear(4, 2)
    with pytest.raises(UserError, match="α"):
        EDPEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=1.0, max_grad_norm=C,
                  sample_rate=0.5, dataset_size=10, verify=False, scaling="public",
                  alphas={p: alpha for p in model.parameters()})


def test_measured_alphas_are_not_labelled_uniform():
    """alphas passed with the default scaling were labelled 'uniform', not leaking, whatever they were measured on
    (e.g. the first private batch, as the paper does)."""
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    alphas = {p: 7.0 for p in model.parameters()}
    with pytest.raises(UserError, match="uniform"):
        EDPEngine(model, optimizer, noise_multiplier=1.0, max_grad_norm=C, sample_rate=0.5, dataset_size=10,
                  verify=False, alphas=alphas, scaling="uniform")
    engine = EDPEngine(model, optimizer, noise_multiplier=1.0, max_grad_norm=C, sample_rate=0.5, dataset_size=10,
                       verify=False, alphas=alphas)  # origin not declared: not claimed as covered
    mechanism = engine.mechanism()
    assert mechanism["scaling"] != "uniform" and mechanism["scaling_leaks"]
    assert "NOT covered" in mechanism["guarantee"]


@pytest.mark.parametrize("public", ["same", "file_inside"])
def test_public_scaling_on_the_training_data_itself_is_refused(tmp_path, public):
    """edp_scaling=public with edp_public_path = data.path measured α on the private training split (its first
    edp_public_examples records: first_step exactly) and labelled it covered, scaling_leaks False, release.json
    'covered'. tests/test_edp.py's integration test ran just that (both paths {sst2})."""
    from dptext.config import load_recipe
    from dptext.finetune.validate import check_data

    folder = tmp_path / "data"
    folder.mkdir()
    train = folder / "train.jsonl"
    train.write_text('{"text": "a b", "label": 0}\n{"text": "c d", "label": 1}\n')
    path = folder if public == "same" else train
    recipe = load_recipe(None, ["data.dataset=jsonl", f"data.path={folder}", "task.type=classification",
                                "privacy.method=edp_sgd", "privacy.edp_scaling=public",
                                f"privacy.edp_public_path={path}", "privacy.target_epsilon=8"])
    with pytest.raises(UserError, match="public"):
        check_data(recipe)
    other = tmp_path / "public.jsonl"
    other.write_text('{"text": "e f", "label": 0}\n')
    check_data(load_recipe(None, ["data.dataset=jsonl", f"data.path={folder}", "task.type=classification",
                                  "privacy.method=edp_sgd", "privacy.edp_scaling=public",
                                  f"privacy.edp_public_path={other}", "privacy.target_epsilon=8"]))
