"""Issue 46: Ctrl-C while the model loads is never lost, exits 130, and suggests `--resume` only when a checkpoint
exists to continue from; nothing half-written is left that a resume would trust.

A real `dptext finetune` process gets SIGINT while a slow stand-in for the model load runs. The stand-in spends its
time in destructors, as a real load does while it frees tensors: a KeyboardInterrupt raised there is printed as
"Exception ignored" and dropped, which is how the run used to go on to train and exit 0 (1 try in 8).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dptext import config, locking
from dptext.errors import RunInterrupted
from dptext.finetune import loop, run_finetune
from dptext.finetune import run as run_module
from test_bad_input_cases import QUICKSTART, TINY, cli, finetune, own_data

pytestmark = [pytest.mark.integration,  # the second Ctrl-C, dropped in a destructor on purpose
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]
ROOT = Path(__file__).resolve().parents[1]
REAL_BUILD = run_module.build_training

SLOW_LOAD = """
import sys, time
from pathlib import Path
from dptext.cli.app import main
from dptext.finetune import run

marker, seconds, in_destructors = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1"
real = run.build_training

class Freed:
    def __del__(self):
        time.sleep(0.002)  # where the time goes: a KeyboardInterrupt raised in here is dropped by Python

def slow_build(recipe):
    marker.write_text("loading")
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        Freed() if in_destructors else time.sleep(0.002)
    return real(recipe)

run.build_training = slow_build
sys.argv = ["dptext", *sys.argv[4:]]
main()
"""


def interrupted_while_loading(tmp_path: Path, args: list[str], seconds: float, presses: int = 1,
                              in_destructors: bool = True) -> tuple[int, str]:
    """Run ``dptext ARGS`` with a load of ``seconds``, press Ctrl-C ``presses`` times once it loads; (code, stderr)."""
    marker = tmp_path / "loading"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen([sys.executable, "-c", SLOW_LOAD, str(marker), str(seconds),
                                "1" if in_destructors else "0", *args], cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the load never started"
        time.sleep(0.02)
    for _ in range(presses):
        time.sleep(0.2)
        process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    return process.returncode, err


def test_ctrl_c_while_a_new_run_loads_stops_it_and_leaves_nothing(tmp_path):
    code, err = interrupted_while_loading(tmp_path, finetune(tmp_path), seconds=2)
    last = err.strip().splitlines()[-1]
    assert code == 130, err  # never lost: the run did not go on to train
    assert last.startswith("error: interrupted before the first training step") and "--resume" not in last, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert not (tmp_path / "run").exists()  # the unstarted run folder is taken back


def ctrl_c_during_load(monkeypatch, presses: int, in_destructor: bool = True) -> None:
    """In-process: the load presses Ctrl-C ``presses`` times (inside a destructor or not), then finishes loading."""
    real = REAL_BUILD

    class Freed:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)
            time.sleep(0.01)  # the handler runs here, inside the destructor (sleep checks for signals)

    def build(recipe):
        for _ in range(presses):
            Freed() if in_destructor else signal.raise_signal(signal.SIGINT)
        return real(recipe)

    monkeypatch.setattr(run_module, "build_training", build)


def test_a_second_ctrl_c_stops_the_load_at_once(tmp_path, capsys, monkeypatch):
    ctrl_c_during_load(monkeypatch, presses=2, in_destructor=False)
    code, err = cli(finetune(tmp_path), capsys)
    last = err.strip().splitlines()[-1]
    assert code == 130 and last.startswith("error: stopped at once by a second Ctrl-C"), err
    assert "--resume" not in last and not (tmp_path / "run").exists()
    # a second Ctrl-C a destructor swallows is not lost either: the first one's flag stops the run once loaded
    ctrl_c_during_load(monkeypatch, presses=2, in_destructor=True)
    code, err = cli(finetune(tmp_path), capsys)
    assert code == 130 and err.strip().splitlines()[-1].startswith("error: interrupted before the first"), err
    assert not (tmp_path / "run").exists()


def test_ctrl_c_while_a_resumed_run_loads_keeps_its_checkpoints_and_says_how_to_resume(tmp_path, capsys,
                                                                                        monkeypatch):
    data, run = own_data(tmp_path), tmp_path / "run"
    recipe = config.load_recipe(QUICKSTART, TINY + [f"data.path={data}", "train.max_steps=4",
                                                    "train.checkpoint_every=1"])
    real_step, calls = loop.train_step, []

    def ctrl_c_at_step_two(training, sampled):
        result = real_step(training, sampled)
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)  # the run stops after this step, checkpointed
        return result

    with monkeypatch.context() as patch:
        patch.setattr(loop, "train_step", ctrl_c_at_step_two)
        with pytest.raises(RunInterrupted, match="after step 2"):
            run_finetune(recipe, out=run)
    locking.release_all()  # as when the command that ran it ended
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    ctrl_c_during_load(monkeypatch, presses=1)
    code, err = cli(["finetune", "--resume", str(run)], capsys)
    last = err.strip().splitlines()[-1]
    assert code == 130 and last.startswith("error: interrupted before training resumed"), err
    assert last.endswith(f"continue with: dptext finetune --resume {run}"), err
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    # the same Ctrl-C on a fresh run in-process: no hint, nothing left (the subprocess test's case, quickly)
    code, err = cli(finetune(tmp_path, out="fresh"), capsys)
    assert code == 130 and "--resume" not in err and not (tmp_path / "fresh").exists(), err
