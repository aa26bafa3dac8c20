"""`dptext mia` end to end on a tiny GPT-2: finetune with an audit split and canaries, then the loss, shadow and
LiRA attacks and canary exposure through the real CLI (table, JSON, PNG), plus model reloading."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from dptext import config
from dptext.cli.app import main
from dptext.errors import UserError
from dptext.finetune import run_finetune

pytestmark = pytest.mark.integration

AUDITED = ["model.name=tiny-gpt2", "data.dataset=e2e", "task.type=table_to_text", "data.max_train_examples=120",
           "data.max_eval_examples=2", "data.max_length=48", "eval.beam_size=1", "eval.max_new_tokens=2",
           "train.batch_size=16", "train.max_steps=3", "privacy.target_epsilon=8", "audit.holdout_examples=30",
           "audit.public_examples=40", "audit.canaries=2", "audit.canary_repetitions=[1, 3]",
           "audit.canary_words=2", "audit.canary_vocabulary=10", "name=audited"]


@pytest.fixture(scope="module")
def audited_run(tmp_path_factory):
    from conftest import SHARED_DATA

    if not SHARED_DATA.is_dir():
        pytest.skip("shared datasets not found")
    out = tmp_path_factory.mktemp("mia") / "run"
    recipe = config.load_recipe(None, AUDITED + [f"data.path={SHARED_DATA}/e2e_nlg"])
    return out, run_finetune(recipe, out=out)


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_finetune_records_members_nonmembers_and_trains_on_members_only(audited_run):
    from dptext.data import load_records

    run, result = audited_run
    audit = run / "audit_not_private"
    members, nonmembers, public = (_rows(audit / f"{n}.jsonl") for n in ("members", "nonmembers", "public"))
    indices = [{r["index"] for r in rows} for rows in (members, nonmembers, public)]
    assert [len(s) for s in indices] == [50, 30, 40] and set.union(*indices) == set(range(120))
    train = load_records(config.load_recipe(run / "resolved.yaml").data, "train")
    assert all(train[r["index"]] == r["record"] for r in members + nonmembers)
    n = 50 + 2 * 1 + 2 * 3  # members plus every canary copy
    assert json.loads((audit / "split.json").read_text())["trained_on"] == n
    privacy = result["privacy"]
    assert privacy["dataset_size"] == n and privacy["delta"] == pytest.approx(1 / (2 * n))
    assert privacy["sample_rate"] == pytest.approx(16 / n)
    canaries = json.loads((audit / "canaries.json").read_text())
    assert [c["repetitions"] for c in canaries["canaries"]] == [1, 1, 3, 3]


def test_reloaded_model_is_the_trained_one_and_scores_are_the_task_loss(audited_run):
    from dptext.attacks.scoring import record_scores
    from dptext.attacks.target import load_trained_run
    from dptext.runs import RunDir

    run, _ = audited_run
    target = load_trained_run(run)
    trained = RunDir(run).load_checkpoint()["model"]
    for name, value in target.model.state_dict().items():
        assert torch.equal(value, trained[name]), name
    records = [r["record"] for r in _rows(run / "audit_not_private" / "members.jsonl")[:5]]
    scores = record_scores(target.task, target.model, records, batch_size=2)
    with torch.no_grad():  # brute force: the task's own per-example loss, one record at a time
        brute = [target.task.per_example_loss(target.model, target.task.collate(target.task.encode([r]))).item()
                 for r in records]
    np.testing.assert_allclose(scores["loss"], brute, rtol=1e-5)
    assert scores["features"].shape == (5, 6)
    mean_loss = scores["features"][:, 0]
    np.testing.assert_allclose(scores["confidence_logit"], -mean_loss - np.log(-np.expm1(-mean_loss)), rtol=1e-5)


def test_cli_mia_loss_shadow_lira_and_canary(audited_run, tmp_path, capsys):
    run, result = audited_run
    with pytest.raises(SystemExit) as code:
        main(["mia", str(run), "--attack", "all", "--references", "2", "--plot", str(tmp_path / "roc.png"),
              "--json"])
    assert code.value.code == 0
    report = json.loads(capsys.readouterr().out)["runs"][0]
    assert set(report["attacks"]) == {"loss", "shadow", "lira"}
    assert report["members"] == report["nonmembers"] == 30
    assert report["privacy"]["epsilon"] == pytest.approx(result["privacy"]["epsilon"]["rdp"]["epsilon"])
    for summary in report["attacks"].values():
        assert 0 <= summary["auc"] <= 1 and 0 <= summary["tpr_at_fpr_0.01"] <= 1
        assert 0 <= summary["epsilon_lower_bound"]["epsilon"] <= report["privacy"]["epsilon"]
    assert (tmp_path / "roc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (json.loads((run / "mia_not_private" / "report.json").read_text())["attacks"].keys()
            == report["attacks"].keys())
    references = sorted((run / "mia_not_private" / "references").iterdir())
    assert [p.name for p in references] == ["ref-00", "ref-01"]
    for ref in references:  # trained on half of the public pool, never on audited points
        used = set(config.load_recipe(ref / "resolved.yaml").audit.train_indices)
        public = {r["index"] for r in _rows(run / "audit_not_private" / "public.jsonl")}
        assert used < public and len(used) == 20

    with pytest.raises(SystemExit) as code:  # side by side, table for people
        main(["mia", str(run), str(run)])
    assert code.value.code == 0
    table = capsys.readouterr().out
    assert "ε = 8" in table and "loss" in table and (run / "mia_not_private" / "roc.png").is_file()

    with pytest.raises(SystemExit) as code:
        main(["mia", "canary", str(run), "--candidates", "500", "--json"])
    assert code.value.code == 0
    exposures = json.loads(capsys.readouterr().out)["runs"][0]
    assert exposures["exhaustive"] and exposures["candidates"] == 100 - 4
    assert [g["repetitions"] for g in exposures["by_repetitions"]] == [1, 3]
    for canary in exposures["canaries"]:
        assert 0 <= canary["exposure_sampled"] <= math.log2(100)


def test_mia_refuses_runs_without_an_audit_split(tmp_path, shared_data, capsys):
    overrides = [o for o in AUDITED if not o.startswith("audit.")] + [f"data.path={shared_data}/e2e_nlg",
                                                                       "train.max_steps=1"]
    run_finetune(config.load_recipe(None, overrides), out=tmp_path / "plain")
    with pytest.raises(SystemExit) as code:
        main(["mia", str(tmp_path / "plain")])
    assert code.value.code == 2
    assert "audit" in capsys.readouterr().err
    classification = ["model.name=tiny-bert", "data.dataset=sst2", f"data.path={shared_data}/sst2",
                      "task.type=classification", "audit.canaries=1", "data.max_train_examples=20"]
    with pytest.raises(UserError, match="language-model task"):
        run_finetune(config.load_recipe(None, classification), out=tmp_path / "cls")


def test_mean_pooling_classifier_reloads(tmp_path, shared_data):
    from dptext.attacks.scoring import record_scores
    from dptext.attacks.target import load_trained_run
    from dptext.runs import RunDir

    overrides = ["model.name=tiny-bert", "data.dataset=sst2", f"data.path={shared_data}/sst2", "task.pooling=mean",
                 "task.type=classification", "eval.split=validation", "data.max_train_examples=40",
                 "data.max_eval_examples=4", "data.max_length=32", "train.batch_size=8", "train.max_steps=2",
                 "audit.holdout_examples=10", "privacy.target_epsilon=8"]
    run_finetune(config.load_recipe(None, overrides), out=tmp_path / "pooled")
    target = load_trained_run(tmp_path / "pooled")
    trained = RunDir(tmp_path / "pooled").load_checkpoint()["model"]
    assert set(target.model.state_dict()) == set(trained)
    for name, value in target.model.state_dict().items():
        assert torch.equal(value, trained[name]), name
    rows = _rows(tmp_path / "pooled" / "audit_not_private" / "nonmembers.jsonl")
    scores = record_scores(target.task, target.model, [r["record"] for r in rows], batch_size=4)
    assert scores["features"].shape == (10, 2)  # sorted class probabilities
    np.testing.assert_allclose(scores["features"].sum(1), 1, rtol=1e-5)
    assert np.all(np.diff(scores["features"], axis=1) <= 0)
