"""`dptext mia --attack one-run` end to end on a tiny GPT-2: the canaries drawn before training with public coins,
a correct DP run whose bound stays below its proven ε, and (slow) a deliberately broken run (its noise switched
off while the ledger still claims ε = 1) whose bound exceeds the claim."""

from __future__ import annotations

import json

import pytest
import torch

from dptext import config
from dptext.attacks.one_run_audit import one_run_audits
from dptext.cli.app import main
from dptext.data.canaries import make_one_run_canaries
from dptext.errors import UserError
from dptext.finetune import run_finetune
from dptext.privacy.noise.optimizer import NoiseSource

pytestmark = pytest.mark.integration

ONE_RUN = ["model.name=tiny-gpt2", "data.dataset=e2e", "task.type=table_to_text", "data.max_train_examples=8",
           "data.max_eval_examples=2", "data.max_length=32", "eval.beam_size=1", "eval.max_new_tokens=2",
           "privacy.target_epsilon=1", "privacy.delta=1e-5", "privacy.max_grad_norm=100", "train.batch_size=16",
           "train.learning_rate=1e-2", "audit.one_run_canaries=32", "audit.canary_words=2",
           "audit.canary_vocabulary=40", "name=one-run", "eval.before_training=false"]


def train(shared_data, out, steps: int):
    recipe = config.load_recipe(None, ONE_RUN + [f"data.path={shared_data}/e2e_nlg", f"train.max_steps={steps}"])
    return run_finetune(recipe, out=out)


def test_one_run_audit_of_a_correct_run(shared_data, tmp_path, capsys):
    result = train(shared_data, tmp_path / "run", 4)
    drawn = json.loads((tmp_path / "run" / "audit_not_private" / "one_run.json").read_text())
    recipe = config.load_recipe(None, ONE_RUN + [f"data.path={shared_data}/e2e_nlg"])
    assert drawn == make_one_run_canaries(recipe.audit)  # drawn from audit.seed alone, before training
    included = sum(c["included"] for c in drawn["canaries"])
    assert len(drawn["canaries"]) == 32 and 8 < included < 24
    split = json.loads((tmp_path / "run" / "audit_not_private" / "split.json").read_text())
    assert split["trained_on"] == 8 + included == result["privacy"]["dataset_size"]  # each included one once
    listed = {f["path"]: f["status"] for f in json.loads((tmp_path / "run" / "release.json").read_text())["files"]}
    assert listed["audit_not_private/one_run.json"] == "not_covered"
    capsys.readouterr()
    with pytest.raises(SystemExit) as code:
        main(["mia", str(tmp_path / "run"), "--attack", "one-run", "--json"])
    assert code.value.code == 0
    report = json.loads(capsys.readouterr().out)["runs"][0]
    assert report["canaries"] == 32 and report["guesses"] == 16 and report["k_plus"] == report["k_minus"] == 8
    assert report["epsilon_lower_bound"] <= report["privacy"]["epsilon"] and not report["exceeds_proven"]
    saved = json.loads((tmp_path / "run" / "mia_not_private" / "one_run.json").read_text())
    assert saved["correct"] == report["correct"]
    with pytest.raises(UserError, match="run it alone"):
        main(["mia", str(tmp_path / "run"), "--attack", "one-run", "--attack", "loss", "--debug"])


def test_a_run_without_one_run_canaries_is_refused(shared_data, tmp_path):
    plain = [o for o in ONE_RUN if not o.startswith("audit.")] + ["audit.holdout_examples=2"]
    run_finetune(config.load_recipe(None, plain + [f"data.path={shared_data}/e2e_nlg", "train.max_steps=1",
                                                   "train.batch_size=4"]), out=tmp_path / "run")
    with pytest.raises(UserError, match="audit.one_run_canaries"):
        one_run_audits([tmp_path / "run"])


@pytest.mark.slow
def test_bound_stays_below_a_correct_runs_epsilon_and_exceeds_a_broken_ones(shared_data, tmp_path, monkeypatch):
    """200 steps each (~40 s per run on one core): the tiny model needs them to memorise its canaries."""
    train(shared_data, tmp_path / "correct", 200)
    monkeypatch.setattr(NoiseSource, "normals", lambda self, std, likes: [torch.zeros(l.shape) for l in likes])
    train(shared_data, tmp_path / "broken", 200)  # no noise at all, the ledger still says ε = 1
    monkeypatch.undo()
    good, bad = one_run_audits([tmp_path / "correct", tmp_path / "broken"])
    assert good["privacy"]["epsilon"] == pytest.approx(1.0, rel=1e-2) == bad["privacy"]["epsilon"]
    assert good["epsilon_lower_bound"] <= good["privacy"]["epsilon"] and not good["exceeds_proven"]
    assert bad["epsilon_lower_bound"] > bad["privacy"]["epsilon"] and bad["exceeds_proven"]
