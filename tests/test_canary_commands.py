"""Canary sweep of the commands that read private data without training a task of their own (issue 25):
`dptext check` (which validates the user's records and must refuse by position, never by content), `dptext data`
(which prints records on purpose and says so), `dptext mia` with every attack and canary exposure (on records that
also carry a canary control code, which `dptext synth` then refuses by position), and a distributed finetune under
torchrun (2 gloo processes on CPU; marked slow). Data and checks: canary_cases.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dptext.cli.app import main
from dptext.cli.data import PRIVATE_NOTE

from canary_cases import (CANARY, INTENTS, RUNS, TEXT, TINY, assert_no_canary, build_data, canary_token_ids, cli,
                          finetune, run_arguments, sweep, write_recipe)
from two_ranks import torchrun_failure

pytestmark = pytest.mark.integration
TORCHRUN_TIMEOUT = 300  # a hang fails the test instead of blocking CI


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    return build_data(tmp_path_factory.mktemp("canary-data"))


def test_check_validates_every_run_and_refuses_records_by_position_only(data, tmp_path, capsys):
    recipe = str(write_recipe(tmp_path / "check.yaml"))
    for name in RUNS:  # the records are read and checked; nothing of them is printed
        resolved = cli(capsys, "check", recipe, *TINY, *run_arguments(name, data))
        assert resolved["model"]["name"] == RUNS[name][1]
    undeclared = {  # the planted record's label, intent or slot tag is outside the declared set, with no "other"
        "label": ["model.name=tiny-bert", f"data.path={data['text']}", "task.type=classification", *TEXT,
                  "task.labels=[negative, positive]"],
        "stray class id": ["model.name=tiny-bert", f"data.path={data['numbered']}", "task.type=classification",
                           *TEXT, "task.labels=[negative, positive]"],
        "intent": ["model.name=tiny-bert", f"data.path={data['slots']}",
                   *[o for o in INTENTS if not o.startswith("task.other_label")]],
    }
    expected = {"label": (f"Training record 4 of '{data['text']}'", "label", "task.labels"),
                "stray class id": (f"Training record 4 of '{data['numbered']}'", "label", "task.labels"),
                "intent": (f"Training record 6 of '{data['slots']}'", "intent", "task.intents")}
    for case, overrides in undeclared.items():
        error = cli(capsys, "check", recipe, *TINY, *overrides, code=2)
        assert all(part in error for part in expected[case]), (case, error)
        assert "7" not in error.replace(expected[case][0], "")  # the stray class id itself stays private


def test_data_prints_records_and_says_they_are_not_covered(data, capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as code:
        main(["data", "jsonl", "--path", str(data["text"]), "--split", "train", "--show", "24", "--json"])
    captured = capsys.readouterr()
    assert code.value.code == 0
    assert CANARY["text"] in captured.out  # by design: the owner inspects their own records
    assert PRIVATE_NOTE in captured.err and "not covered" in PRIVATE_NOTE


AUDIT = ["audit.holdout_examples=6", "audit.public_examples=8", "audit.canaries=1", "audit.canary_repetitions=[1]",
         "audit.canary_words=2", "audit.canary_vocabulary=10"]


def test_mia_attacks_and_canary_exposure_hold_no_canary(data, tmp_path, capsys):
    # the records also carry a canary control code: DP training may read it, nothing may write or print it
    run = finetune(capsys, tmp_path / "audited", *run_arguments("language_modeling", data, "coded"), *AUDIT)
    report = cli(capsys, "mia", str(run), "--attack", "all", "--references", "2")
    assert set(report["runs"][0]["attacks"]) == {"loss", "shadow", "lira"}
    exposure = cli(capsys, "mia", "canary", str(run), "--candidates", "50")
    assert exposure["runs"][0]["by_repetitions"][0]["repetitions"] == 1
    status = sweep(run, canary_token_ids(RUNS["language_modeling"][1]))
    assert status["mia_not_private/report.json"] == "not_covered"
    assert any(path.startswith("mia_not_private/references/") for path in status)
    error = cli(capsys, "synth", str(run), "--out", str(tmp_path / "synthetic"), "--n", "4", code=2)
    assert "control code outside the declared set (task.code_domain)" in error


@pytest.mark.slow  # 36-43 s on this project's loaded 2-core machine (two processes, each importing torch)
def test_torchrun_finetune_holds_no_canary(data, tmp_path):
    run = tmp_path / "distributed"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "dptext", "finetune", str(write_recipe(tmp_path / "distributed.yaml")), *TINY,
               *run_arguments("classification", data), "--out", str(run), "--json"]
    done = subprocess.run(command, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=TORCHRUN_TIMEOUT)
    assert done.returncode == 0, torchrun_failure(done)
    assert_no_canary(done.stdout + done.stderr, "the output of torchrun dptext finetune")
    sweep(run, canary_token_ids(RUNS["classification"][1]))
    assert json.loads((run / "result.json").read_text())["privacy"]["mechanism"]["processes"] == 2

