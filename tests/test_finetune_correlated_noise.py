"""`privacy.mechanism: banded_mf` and `blt` end to end on a tiny model: the run trains, its ledger reports the
Gaussian mechanism's ε at the target, the strategy is written and registered, a resume is bit-exact, mismatches
are refused."""

from __future__ import annotations

import json

import pytest
import torch

from dptext import config
from dptext.accounting import PrivacyLedger
from dptext.accounting.banded_mf import Participation, toeplitz_sensitivity
from dptext.accounting.blt import BLT, blt_sensitivity
from dptext.cli.app import main
from dptext.errors import UserError
from dptext.finetune import run_finetune

pytestmark = pytest.mark.integration

BANDED = ["model.name=tiny-bert", "data.dataset=sst2", "data.path={data}/sst2", "eval.split=validation",
          "task.type=classification", "name=banded", "data.max_train_examples=48", "data.max_eval_examples=8",
          "data.max_length=32", "train.batch_size=12", "train.max_steps=6", "train.log_every=1",
          "privacy.target_epsilon=8", "train.learning_rate=1e-3", "privacy.mechanism=banded_mf",
          "privacy.sampling=cyclic", "privacy.mf_bands=3"]


DP_SGD = [o for o in BANDED if not o.startswith(("privacy.mechanism", "privacy.mf_bands"))]
MECHANISMS = {"banded_mf": BANDED, "blt": DP_SGD + ["privacy.mechanism=blt", "privacy.blt_buffers=2"]}


def banded_recipe(shared_data, *extra: str, mechanism: str = "banded_mf"):
    return config.load_recipe(None, [o.format(data=shared_data) for o in MECHANISMS[mechanism]] + list(extra))


def recomputed_sensitivity(strategy: dict) -> float:
    """sens(C) of the written strategy, recomputed for its (k, P) schema: 1 when it was scaled as claimed."""
    schema = Participation(strategy["max_participations"], strategy["separation"])
    if strategy.get("mechanism") == "blt":
        blt = BLT(strategy["c0"], tuple(strategy["omega"]), tuple(strategy["theta"]))
        return blt_sensitivity(blt, strategy["steps"], schema)
    return toeplitz_sensitivity(strategy["coefficients"], strategy["steps"], schema)


@pytest.mark.parametrize("mechanism, size, strategy_key", [("banded_mf", "bands", "coefficients"),
                                                           ("blt", "buffers", "omega")])
def test_mf_run_trains_and_accounts_the_gaussian_mechanism(shared_data, tmp_path, capsys, mechanism, size,
                                                           strategy_key):
    result = run_finetune(banded_recipe(shared_data, mechanism=mechanism), out=tmp_path / "run")
    run = tmp_path / "run"
    strategy = json.loads((run / "mf_strategy.json").read_text())
    assert strategy[size] == {"bands": 3, "buffers": 2}[size] and strategy["steps"] == 6
    assert strategy["separation"] == 4 and strategy["max_participations"] == 2  # 48 / 12 bins, ⌈6 / 4⌉
    assert recomputed_sensitivity(strategy) == pytest.approx(1.0)
    listed = {f["path"]: f["status"] for f in json.loads((run / "release.json").read_text())["files"]}
    assert listed["mf_strategy.json"] == "public"
    saved = json.loads((run / "ledger.json").read_text())
    assert saved["mechanism"]["method"] == mechanism
    assert saved["mechanism"][strategy_key] == strategy[strategy_key]
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


@pytest.mark.parametrize("mechanism", ["banded_mf", "blt"])
def test_mf_run_resumes_bit_exactly(shared_data, tmp_path, interrupt_training, mechanism):
    extra = ("train.checkpoint_every=2", "privacy.reproducible_noise=true")
    run_finetune(banded_recipe(shared_data, *extra, mechanism=mechanism), out=tmp_path / "a")
    resume_normally = interrupt_training(5)  # after the step-4 checkpoint, which holds the noise buffers
    with pytest.raises(KeyboardInterrupt):
        run_finetune(banded_recipe(shared_data, *extra, mechanism=mechanism), out=tmp_path / "b")
    resume_normally()
    run_finetune(resume=tmp_path / "b")
    weights = [torch.load(tmp_path / r / "checkpoints" / "step-00000006.pt", weights_only=False)["model"]
               for r in ("a", "b")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.parametrize("mechanism, extra, message", [
    ("banded_mf", ["privacy.sampling=poisson"], "Poisson"),
    ("banded_mf", ["privacy.mf_bands=5"], "exceeds the 4 steps per epoch"),
    ("banded_mf", ["privacy.method=edp_sgd"], "not eDP-SGD's"),
    ("blt", ["privacy.sampling=poisson"], "Poisson batches break that schema; use privacy.sampling=cyclic with blt"),
    ("blt", ["privacy.method=edp_sgd"], "privacy.mechanism=blt replaces DP-SGD's noise, not eDP-SGD's"),
    ("blt", ["privacy.blt_buffers=17"], "blt_buffers"),
    ("blt", ["privacy.mf_bands=3"], "mf_bands"),  # a banded MF key in a BLT recipe means nothing: refused
])
def test_mismatched_settings_are_refused(shared_data, tmp_path, mechanism, extra, message):
    with pytest.raises(UserError, match=message):
        run_finetune(banded_recipe(shared_data, *extra, mechanism=mechanism), out=tmp_path / "run")


def test_cyclic_sampling_is_refused_for_dp_sgd(shared_data, tmp_path):
    recipe = config.load_recipe(None, [o.format(data=shared_data) for o in DP_SGD])
    with pytest.raises(UserError, match="only with privacy.mechanism=banded_mf or blt"):
        run_finetune(recipe, out=tmp_path / "run")
    with pytest.raises(UserError, match="blt"):  # a BLT key without mechanism=blt
        config.load_recipe(None, [o.format(data=shared_data) for o in DP_SGD] + ["privacy.blt_buffers=2"])
