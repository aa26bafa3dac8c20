"""Crash safety of `dptext finetune`: SIGKILL at random moments, Ctrl-C, then --resume.

A tiny private run (tiny-bert on a jsonl file of its own, a checkpoint after every step so that kills often
land inside a checkpoint write) is killed, resumed, killed again..., and finally resumed to the end. It must
finish with: the ledger's steps equal to the planned steps, weights identical to an uninterrupted run of the
same recipe (so exactly those steps, each once, were applied), metrics.jsonl holding every step exactly once,
and every checkpoint on disk loadable. Ctrl-C finishes the step, checkpoints, prints the --resume command and
exits 130.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dptext import config
from dptext.finetune import run_finetune

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
STEPS = 10


def overrides(data: Path) -> list[str]:
    return ["model.name=tiny-bert", "task.type=classification", f"data.path={data}", "data.max_length=16",
            "data.max_eval_examples=4", "train.batch_size=8", f"train.max_steps={STEPS}", "train.log_every=1",
            "train.checkpoint_every=1", "privacy.target_epsilon=8", "eval.split=validation", "name=crash",
            "task.labels=[negative,positive]", "privacy.reproducible_noise=true"]  # comparable with a reference run


def recipe_file(data: Path) -> Path:
    """The recipe as a YAML file: `dptext finetune` takes a recipe path first, overrides after it."""
    path = data.parent / "crash.yaml"
    path.write_text(config.dump_recipe(config.load_recipe(None, overrides(data))))
    return path


def start(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "dptext", "finetune", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def metric_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text(encoding="utf-8").split("\n"):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        # a training step (loss lives in diagnostics_not_private.jsonl)
        if "epsilon" in record and "split" not in record:
            steps.append(record["step"])
    return steps


def wait_for_training(process: subprocess.Popen, run: Path, min_step: int = 1, timeout: float = 120) -> bool:
    """True once the run has logged ``min_step`` steps; False if the process ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        steps = metric_steps(run)
        if steps and max(steps) >= min_step:
            return True
        time.sleep(0.05)
    raise AssertionError("the run did not start training in time")


def check_finished(run: Path, reference: dict) -> None:
    ledger = json.loads((run / "ledger.json").read_text())
    assert ledger["steps"] == STEPS
    assert sorted(metric_steps(run)) == list(range(1, STEPS + 1)), metric_steps(run)
    for checkpoint in (run / "checkpoints").glob("step-*.pt"):  # every checkpoint left on disk loads
        torch.load(checkpoint, map_location="cpu", weights_only=False)
    assert not list((run / "checkpoints").glob(".*.tmp")), "a temporary checkpoint file was left behind"
    from safetensors.torch import load_file

    weights = load_file(str(run / "model" / "model.safetensors"))
    for name, tensor in reference.items():
        assert torch.equal(weights[name], tensor), f"{name} differs from the uninterrupted run"


def reference_weights(data: Path, tmp_path: Path) -> dict:
    from safetensors.torch import load_file

    run_finetune(config.load_recipe(None, overrides(data)), out=tmp_path / "reference")
    return load_file(str(tmp_path / "reference" / "model" / "model.safetensors"))


def kill_and_resume(data: Path, tmp_path: Path, kills: int, seed: int) -> Path:
    run = tmp_path / "run"
    rng = random.Random(seed)
    process = start([str(recipe_file(data)), "--out", str(run)])
    for _ in range(kills):
        if wait_for_training(process, run, min_step=max(metric_steps(run) or [0]) + 1):
            time.sleep(rng.uniform(0.0, 0.4))  # a random moment: a step, a metrics line, or a checkpoint write
            process.send_signal(signal.SIGKILL)
        process.wait()
        process = start(["--resume", str(run)])
    _, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    return run


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_many_random_sigkills_then_resume(reviews, tmp_path, seed):
    reference = reference_weights(reviews, tmp_path)
    run = kill_and_resume(reviews, tmp_path, kills=5, seed=seed)
    check_finished(run, reference)


def test_ctrl_c_then_sigkill_then_resume_finishes_exactly(reviews, tmp_path):
    """The default-run variant (three process starts): Ctrl-C, resume, SIGKILL at a random moment, resume."""
    run = tmp_path / "run"
    process = start([str(recipe_file(reviews)), "--out", str(run)])
    assert wait_for_training(process, run, min_step=2)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: interrupted after step ") and f"dptext finetune --resume {run}" in last, err
    stopped = int(last.split("after step ")[1].split()[0])
    assert (run / "checkpoints" / f"step-{stopped:08d}.pt").exists() and max(metric_steps(run)) == stopped

    resumed = start(["--resume", str(run)])
    if wait_for_training(resumed, run, min_step=stopped + 1):
        time.sleep(random.Random(0).uniform(0.0, 0.4))
        resumed.send_signal(signal.SIGKILL)
    out, err = resumed.communicate(timeout=120)
    assert f"Resuming at step {stopped} of {STEPS}" in out, err

    final = start(["--resume", str(run)])
    _, err = final.communicate(timeout=300)
    assert final.returncode == 0, err
    check_finished(run, reference_weights(reviews, tmp_path))


def test_ctrl_c_between_log_lines_keeps_the_kept_steps_time(reviews, tmp_path, monkeypatch):
    """A run stopped by Ctrl-C after a step no log line covered (log_every > 1) writes that step's clock: a resumed
    run's wall time is summed over invocations from these records, and would otherwise lose the steps kept since
    the last log line (DistilDP's CPU DPKD student lost ~10 minutes this way)."""
    from dptext.errors import RunInterrupted
    from dptext.finetune import loop

    original, calls = loop.train_step, []

    def step_then_ctrl_c(training, sampled):
        result = original(training, sampled)
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGINT)  # the loop's handler: stop after this step
        return result

    monkeypatch.setattr(loop, "train_step", step_then_ctrl_c)
    run = tmp_path / "run"
    recipe = config.load_recipe(None, overrides(reviews) + ["train.log_every=100", "train.checkpoint_every=100"])
    with pytest.raises(RunInterrupted):
        run_finetune(recipe, out=run)
    records = [json.loads(line) for line in (run / "diagnostics_not_private.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("interrupted")) for r in records] == [(3, True)], records
    assert records[0]["seconds"] > 0 and (run / "checkpoints" / "step-00000003.pt").exists()
