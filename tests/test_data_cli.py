"""`dptext data`: per-split counts and first records for people and scripts; bad input exits 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dptext.cli.app import main


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err


def test_json_counts_every_split_and_shows_the_first_records(capsys, shared_data):
    code, out, _ = run_main(capsys, "data", "snips", "--path", str(shared_data / "snips"), "--show", "2", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["counts"] == {"train": 13_084, "validation": 700, "test": 700}
    assert result["shown_split"] == "train" and len(result["examples"]) == 2
    assert result["examples"][0]["intent"] == "PlayMusic" and result["errors"] == {}


def test_table_output_for_people(capsys, shared_data):
    code, out, _ = run_main(capsys, "data", "e2e", "--path", str(shared_data / "e2e_nlg"), "--show", "1")
    assert code == 0
    assert "42,061" in out and "4,672" in out and "4,693" in out
    assert "name[The Vaults]" in out and "First 1 train records" in out


def test_one_split_and_a_missing_split_reported_beside_the_others(capsys, shared_data):
    code, out, _ = run_main(capsys, "data", "sst2", "--path", str(shared_data / "sst2"), "--split", "dev", "--json")
    assert code == 0 and json.loads(out)["counts"] == {"validation": 872}
    code, out, err = run_main(capsys, "data", "dart", "--path", str(shared_data / "dart"), "--show", "0", "--json")
    assert code == 0
    assert json.loads(out)["counts"] == {"train": None, "validation": 6_980, "test": 12_552}
    assert "train: DART has no train file" in err
    code, _, err = run_main(capsys, "data", "dart", "--path", str(shared_data / "dart"), "--split", "train")
    assert code == 2 and "no train file" in err


@pytest.mark.parametrize("args, fragment", [
    (("data", "sst2", "--path", "/no/such/folder"), "does not exist"),
    (("data", "e2ee"), "did you mean 'e2e'"),
    (("data", "jsonl"), "needs local files"),
])
def test_bad_input_is_one_sentence_with_exit_code_2(capsys, args, fragment):
    code, _, err = run_main(capsys, *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0]


def test_unreachable_hub_through_the_real_datasets_library(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "dptext", "data", "qnli", "--split", "train"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "nyu-mll/glue (qnli)" in proc.stderr and "pass data.path=" in proc.stderr
