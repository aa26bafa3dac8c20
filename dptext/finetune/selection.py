"""Model selection on the validation split: early stopping and the best checkpoint.

Convergence runs train "until the validation metric stops improving" (issue 16). The periodic
evaluations of ``train.eval_every`` already run on the validation split, never on test; this
module watches the task's primary metric across them. ``train.early_stopping_patience`` stops the
run after that many evaluations without improvement, and ``train.keep_best`` puts the weights
of the best evaluation back before the final evaluation and before the model is saved.

Privacy: the choice uses only validation data, which the guarantee does not cover anyway (it
protects the training examples); a private run stopped early has taken fewer steps than it was
calibrated for, and its ledger, which records the steps actually taken, reports the smaller ε.

The selection state (best value and step, evaluations since) goes into every checkpoint and the
best weights into ``best.pt`` (atomically), so an interrupted run resumes the same selection.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from dptext.errors import UserError
from dptext.runs import RunDir, atomic_write

BEST = "best.pt"


@dataclass
class Selection:
    metric: str
    higher_is_better: bool
    patience: int | None = None  # None: never stop early, only track the best
    best_value: float | None = None
    best_step: int | None = None
    evaluations_since_best: int = 0

    def observe(self, scores: dict[str, float], step: int) -> bool:
        """Record one validation evaluation; True when it is the best so far."""
        if self.metric not in scores:
            raise UserError(f"The validation evaluation has no '{self.metric}' to select on; "
                            "unset train.early_stopping_patience and train.keep_best for this task.")
        value = float(scores[self.metric])
        better = self.best_value is None or (value > self.best_value if self.higher_is_better
                                             else value < self.best_value)
        if better:
            self.best_value, self.best_step, self.evaluations_since_best = value, step, 0
        else:
            self.evaluations_since_best += 1
        return better

    @property
    def should_stop(self) -> bool:
        return self.patience is not None and self.evaluations_since_best >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_value, self.best_step = state["best_value"], state["best_step"]
        self.evaluations_since_best = state["evaluations_since_best"]


def make_selection(recipe: Any, task: Any, distributed: bool) -> Selection | None:
    """The recipe's selection, or None when it asks for neither early stopping nor the best checkpoint."""
    cfg = recipe.train
    if cfg.early_stopping_patience is None and not cfg.keep_best:
        return None
    if not cfg.eval_every:
        raise UserError("train.early_stopping_patience and train.keep_best select on the periodic validation "
                        "evaluations; set train.eval_every (e.g. one epoch's steps) as well.")
    if cfg.early_stopping_patience is not None and cfg.early_stopping_patience < 1:
        raise UserError(f"train.early_stopping_patience is {cfg.early_stopping_patience}; give a number of "
                        "evaluations ≥ 1, or leave it empty to train every planned step.")
    if distributed:  # only rank 0 evaluates; the stop decision would have to be broadcast
        raise UserError("Early stopping and best-checkpoint selection run in one process only; "
                        "launch without torchrun or unset train.early_stopping_patience and train.keep_best.")
    return Selection(task.primary_metric, task.higher_is_better, cfg.early_stopping_patience)


def save_best(run: RunDir, model: Any, selection: Selection) -> None:
    state = {"step": selection.best_step, "value": selection.best_value, "model": model.state_dict()}
    atomic_write(run.path / BEST, lambda f: torch.save(state, f), binary=True)


def restore_best(run: RunDir, model: Any, selection: Selection) -> None:
    """Load the best evaluation's weights into ``model`` (the run's final weights may be worse)."""
    path = run.path / BEST
    if selection.best_step is None or not path.exists():
        return  # no periodic evaluation happened (a run shorter than eval_every): keep the final weights
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state["step"] != selection.best_step:
        raise UserError(f"{path} holds step {state['step']} but the run's best evaluation was step "
                        f"{selection.best_step}; delete {path} and resume to redo the selection.")
    model.load_state_dict(state["model"])


def summary(selection: Selection | None, steps_run: int) -> dict[str, Any]:
    if selection is None:
        return {}
    return {"selection": {"metric": selection.metric, "split": "validation", "best_step": selection.best_step,
                          "best_value": selection.best_value, "steps_run": steps_run,
                          "early_stopped": selection.should_stop}}
