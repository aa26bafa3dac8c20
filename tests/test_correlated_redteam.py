"""Red-team checks of the correlated-noise engines (banded MF, BLT) and their tooling: each test passes on a correct
engine and failed on the code it was written against (branch redteam-mf)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dptext.accounting.blt import BLT
from dptext.errors import UserError
from dptext.privacy.mechanisms.blt import BLTEngine
from dptext.privacy.mechanisms.banded_mf import BandedMFEngine

CLIP = 1.0


def _engine(mechanism: str, model: nn.Module, dataset_size: int = 2):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    common = dict(noise_multiplier=0.0, max_grad_norm=CLIP, dataset_size=dataset_size, steps=1, bins=1, seed=3,
                  verify=False)
    if mechanism == "banded_mf":
        return BandedMFEngine(model, optimizer, coefficients=[1.0], **common)
    return BLTEngine(model, optimizer, blt=BLT(1.0, (0.0,), (0.0,)), **common)


def _clipped_sum(mechanism: str, inputs: torch.Tensor, units) -> torch.Tensor | None:
    """The clipped sum of a one-weight model's examples (loss_i = w·x_i, so example i's gradient is x_i), or None
    when the engine refuses the ``units``."""
    model = nn.Linear(inputs.shape[1], 1, bias=False)
    engine = _engine(mechanism, model, dataset_size=2)
    loss = model(inputs).reshape(-1)
    try:
        engine.accumulate(loss, units=units)
    except UserError:
        return None
    return engine.clipped_grads()[model.weight].flatten()


@pytest.mark.parametrize("mechanism", ["banded_mf", "blt"])
def test_removing_one_example_moves_the_clipped_sum_by_at_most_c_whatever_units_are_passed(mechanism):
    """The correlated-noise engines are accounted example-level with sensitivity C per participation (mechanism():
    unit "example"; user-level DP is refused). ``accumulate(loss, units=...)`` clips each *unit's* summed
    gradient instead: two examples of one unit with opposed gradients then move the clipped sum by 2C when one is
    removed, twice what ε was computed for. The engine must refuse the units (or keep the move within C)."""
    pair = torch.tensor([[3.0, 0.0], [-1.5, 0.0]])  # gradients 3e and −1.5e: the unit's sum 1.5e clips to e
    with_both = _clipped_sum(mechanism, pair, torch.tensor([0, 0]))
    if with_both is None:
        return  # refused: the engine does not clip several examples as one
    without_first = _clipped_sum(mechanism, pair[1:], torch.tensor([0]))
    assert without_first is not None
    moved = float((with_both - without_first).norm())
    assert moved <= CLIP * (1 + 1e-6), f"one example moved the clipped sum by {moved / CLIP:.2f}·C"


@pytest.mark.parametrize("mechanism", ["banded_mf", "blt"])
def test_recipe_sigma_listing_reports_the_correlated_runs_own_sigma(tmp_path: Path, mechanism):
    """`dptext account --eps E --recipes DIR` lists "the σ its own accountant calibrates" for each recipe. A banded
    MF / BLT run calibrates σ as one Gaussian mechanism (q = 1, one step, no amplification: mf_noise_multiplier),
    not DP-SGD's Poisson-amplified σ at q = B/n over S steps; listing the latter misstates what the run draws
    (here 0.706 for the run's 0.586 at ε = 8; on sst2's schedule it understates σ)."""
    from dptext.accounting.plan import recipe_sigmas, shipped_recipes_dir
    from dptext.config import load_recipe
    from dptext.finetune.banded_mf import mf_noise_multiplier

    text = (shipped_recipes_dir() / "quickstart.yaml").read_text()
    extra = {"banded_mf": "  mechanism: banded_mf\n  sampling: cyclic\n  mf_bands: 4\n",
             "blt": "  mechanism: blt\n  sampling: cyclic\n"}[mechanism]
    text = text.replace("privacy:\n", "privacy:\n" + extra, 1)
    (tmp_path / "mf.yaml").write_text(text)
    recipe = load_recipe(tmp_path / "mf.yaml")
    assert recipe.privacy.mechanism == mechanism
    row = recipe_sigmas(8.0, tmp_path, train_size=lambda data: 6000)[0]
    delta = 1 / (2 * 6000)
    expected = mf_noise_multiplier(recipe.privacy, delta)
    assert row["noise_multiplier"] is None or row["noise_multiplier"] == pytest.approx(expected, rel=1e-3), (
        f"listed σ {row['noise_multiplier']:.4g}, the {mechanism} run draws σ {expected:.4g}")


@pytest.mark.parametrize("before,after", [("dp_sgd", "blt"), ("banded_mf", "dp_sgd"), ("blt", "banded_mf")])
def test_a_resume_under_another_mechanism_is_refused_in_a_sentence(before, after):
    """A DP-SGD checkpoint resumed as banded MF / BLT (or back) with a pinned σ and the same n, δ and q passed the
    account check (the mechanism was not compared) and stopped only at a KeyError loading the noise state; had that
    load succeeded, the MF ledger would have dropped the DP-SGD steps from ε (session-29 red team)."""
    from types import SimpleNamespace

    from dptext.accounting import PrivacyLedger
    from dptext.finetune.checkpointing import check_same_account

    def ledger(method):
        made = PrivacyLedger(delta=1e-5, dataset_size=100, accountant="rdp")
        made.mechanism = {"method": method, "unit": "example", "noise_multiplier": 1.0, "strategy_sensitivity": 1.0}
        return made

    training = SimpleNamespace(private=True, ledger=ledger(after), plan=SimpleNamespace(sample_rate=0.1),
                               recipe=SimpleNamespace(privacy=SimpleNamespace(method="dp_sgd")), noise_multiplier=1.0)
    with pytest.raises(UserError, match=f"mechanism {before} -> {after}"):
        check_same_account(training, {"ledger": ledger(before).to_dict()})
    check_same_account(training, {"ledger": ledger(after).to_dict()})  # the same mechanism resumes
