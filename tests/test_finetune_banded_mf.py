"""`privacy.mechanism: banded_mf` end to end on a tiny model: the run trains, its ledger reports the Gaussian
mechanism's ε at the target, the strategy is written and registered, a resume is bit-exact, mismatches refused."""

from __future__ import annotations

import json

import pytest
import torch

from dptext import config
from dptext.accounting import PrivacyLedger
from dptext.accounting.banded_mf import Participation, toeplitz_sensitivity
from dptext.cli.app import main
from dptext.errors import UserError
from dptext.finetune import run_finetune

pytestmark = pytest.mark.integration

BANDED = ["model.name=tiny-bert", "data.dataset=sst2", "data.path={data}/sst2", "eval.split=validation",
          "task.type=classification", "name=banded", "data.max_train_examples=48", "data.max_eval_examples=8",
          "data.max_length=32", "train.batch_size=12", "train.max_steps=6", "train.log_every=1",
          "privacy.target_epsilon=8", "train.learning_rate=1e-3", "privacy.mechanism=banded_mf",
          "privacy.sampling=cyclic", "privacy.mf_bands=3"]


def banded_recipe(shared_data, *extra: str):
    return config.load_recipe(None, [o.format(data=shared_data) for o in BANDED] + list(extra))


def test_banded_mf_trains_and_accounts_the_gaussian_mechanism(shared_data, tmp_path, capsys):
    result = run_finetune(banded_recipe(shared_data), out=tmp_path / "run")
    run = tmp_path / "run"
    strategy = json.loads((run / "mf_strategy.json").read_text())
    assert strategy["bands"] == 3 and strategy["steps"] == 6 and strategy["separation"] == 4  # 48 / 12 bins
    assert strategy["max_participations"] == 2
    sens = toeplitz_sensitivity(strategy["coefficients"], 6, Participation(2, 4))
    assert sens == pytest.approx(1.0)
    listed = {f["path"]: f["status"] for f in json.loads((run / "release.json").read_text())["files"]}
    assert listed["mf_strategy.json"] == "public"
    saved = json.loads((run / "ledger.json").read_text())
    assert saved["mechanism"]["method"] == "banded_mf"
    assert saved["mechanism"]["coefficients"] == strategy["coefficients"]
    assert saved["steps"] == 6 and result["privacy"]["steps"] == 6
    ledger = PrivacyLedger.from_dict(saved)  # what `dptext account RUN_DIR` reads
    assert ledger.epsilon("rdp").epsilon == pytest.approx(8.0, rel=1e-3)  # calibrated for the one mechanism
    assert result["privacy"]["epsilon"]["rdp"]["epsilon"] == pytest.approx(8.0, rel=1e-3)
    with pytest.raises(SystemExit) as code:  # `dptext account RUN_DIR`: the same ε, and no "not covered" warning
        main(["account", str(run), "--json"])
    assert code.value.code == 0
    reported = capsys.readouterr()
    rows = {row["method"]: row for row in json.loads(reported.out)["results"]}
    assert rows["rdp"]["epsilon"] == pytest.approx(8.0, rel=1e-3) and "NOT a guarantee" not in reported.err
    # the same steps under DP-SGD's (Poisson) accounting would be another number: the mechanism decides
    assert abs(PrivacyLedger.from_dict({**saved, "mechanism": None}).epsilon("rdp").epsilon - 8.0) > 1.0


def test_banded_mf_resumes_bit_exactly(shared_data, tmp_path, interrupt_training):
    extra = ("train.checkpoint_every=2", "privacy.reproducible_noise=true")
    run_finetune(banded_recipe(shared_data, *extra), out=tmp_path / "a")
    resume_normally = interrupt_training(5)
    with pytest.raises(KeyboardInterrupt):
        run_finetune(banded_recipe(shared_data, *extra), out=tmp_path / "b")
    resume_normally()
    run_finetune(resume=tmp_path / "b")
    weights = [torch.load(tmp_path / r / "checkpoints" / "step-00000006.pt", weights_only=False)["model"]
               for r in ("a", "b")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.parametrize("extra, message", [
    (["privacy.sampling=poisson"], "Poisson"),
    (["privacy.mf_bands=5"], "exceeds the 4 steps per epoch"),
    (["privacy.method=edp_sgd"], "not eDP-SGD's"),
])
def test_mismatched_sampling_or_bands_are_refused(shared_data, tmp_path, extra, message):
    with pytest.raises(UserError, match=message):
        run_finetune(banded_recipe(shared_data, *extra), out=tmp_path / "run")


def test_cyclic_sampling_is_refused_for_dp_sgd(shared_data, tmp_path):
    dp_sgd = [o for o in BANDED if not o.startswith(("privacy.mechanism", "privacy.mf_bands"))]
    recipe = config.load_recipe(None, [o.format(data=shared_data) for o in dp_sgd])
    with pytest.raises(UserError, match="only with privacy.mechanism=banded_mf"):
        run_finetune(recipe, out=tmp_path / "run")
