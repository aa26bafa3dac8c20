"""Early stopping and best-checkpoint selection on the validation split (train.early_stopping_patience, keep_best)."""

from __future__ import annotations

import json

import pytest
import torch

from dptext import config
from dptext.errors import UserError
from dptext.finetune import run_finetune
from dptext.finetune import run as finetune_run
from dptext.finetune.selection import BEST, Selection


def test_selection_tracks_best_and_stops_after_patience():
    lower = Selection("ser", higher_is_better=False, patience=2)
    assert lower.observe({"ser": 30.0}, 10) and lower.observe({"ser": 20.0}, 20)
    assert not lower.observe({"ser": 20.0}, 30)  # a tie is no improvement
    assert not lower.should_stop
    assert not lower.observe({"ser": 25.0}, 40)
    assert lower.should_stop and (lower.best_step, lower.best_value) == (20, 20.0)
    higher = Selection("accuracy", higher_is_better=True)
    higher.observe({"accuracy": 50.0}, 1)
    assert higher.observe({"accuracy": 51.0}, 2) and not higher.observe({"accuracy": 10.0}, 3)
    assert not higher.should_stop  # no patience: track the best only
    copy = Selection("accuracy", True)
    copy.load_state_dict(higher.state_dict())
    assert copy == higher


def test_selection_needs_the_metric():
    with pytest.raises(UserError, match="no 'ser'"):
        Selection("ser", False, 1).observe({"accuracy": 1.0}, 1)


def _recipe(shared_data, *extra):
    return config.load_recipe(None, [
        "model.name=tiny-bert", "data.dataset=sst2", f"data.path={shared_data}/sst2", "task.type=classification",
        "eval.split=validation", "data.max_train_examples=48", "data.max_eval_examples=8", "data.max_length=32",
        "train.batch_size=12", "train.max_steps=8", "train.log_every=1", "train.learning_rate=1e-2",
        "privacy.target_epsilon=8", *extra])


def test_selection_needs_periodic_evaluation(shared_data, tmp_path):
    with pytest.raises(UserError, match="train.eval_every"):
        run_finetune(_recipe(shared_data, "train.early_stopping_patience=2"), out=tmp_path / "run")


@pytest.mark.integration
def test_private_run_stops_early_keeps_best_weights_and_accounts_steps_taken(shared_data, tmp_path, monkeypatch):
    scripted = iter([50.0, 60.0, 55.0, 54.0])  # validation accuracy at steps 1..4: best at 2, patience 2 -> stop at 4
    snapshots = []

    def scripted_evaluator(training, output):
        def evaluate(records, journal=None):  # the final evaluation passes its journal
            snapshots.append([p.detach().clone() for p in training.model.parameters()])
            return {"accuracy": next(scripted, 0.0)}
        return evaluate

    monkeypatch.setattr(finetune_run, "_evaluator", scripted_evaluator)
    run_dir = tmp_path / "run"
    result = run_finetune(_recipe(shared_data, "train.eval_every=1", "train.early_stopping_patience=2",
                                  "train.keep_best=true"), out=run_dir)
    assert result["steps_run"] == 4
    assert result["selection"] == {"metric": "accuracy", "split": "validation", "best_step": 2, "best_value": 60.0,
                                   "steps_run": 4, "early_stopped": True}
    assert torch.load(run_dir / BEST, weights_only=False)["step"] == 2
    # the final evaluation (5th call) saw the weights of the best evaluation (2nd call), not those of step 4
    assert len(snapshots) == 5
    assert all(torch.equal(a, b) for a, b in zip(snapshots[4], snapshots[1]))
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[4], snapshots[3]))
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["steps"] == 4  # 4 of 8 planned steps were taken, so less than the calibrated ε was spent
    assert result["privacy"]["epsilon"]["rdp"]["epsilon"] < 8.0
    validation = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                  if '"split"' in line]
    assert [r["step"] for r in validation] == [1, 2, 3, 4, 4]  # four periodic evaluations, then the final one
    # resuming a finished early-stopped run reports its result without training again
    assert run_finetune(resume=run_dir)["steps_run"] == 4
