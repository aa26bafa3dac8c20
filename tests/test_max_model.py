"""The max-model benchmark (issue 42) rehearsed at tiny scale: both modes train, the DP row carries the proof's
own peak and time (in DP steps), and the largest fitting size is reported per mode."""

from __future__ import annotations

import json
import sys

import pytest
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import max_model  # noqa: E402


def test_the_tiny_rehearsal_reports_both_modes_and_the_proofs_cost(tmp_path):
    out = tmp_path / "max_model.json"
    result = max_model.main(["--tiny", "--layers", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    rows = {row["mode"]: row for row in result["rows"]}
    assert rows["nonprivate"]["fits"] and rows["dp"]["fits"]
    dp = rows["dp"]
    assert dp["probe_seconds"] > 0 and dp["probe_steps"] == dp["probe_seconds"] / dp["step_seconds"]
    assert dp["probe_peak_bytes"] > 0 and dp["peak_bytes"] > 0
    assert result["largest"] == {mode: {"layers": 1, "parameters": rows[mode]["parameters"]} for mode in rows}


def test_a_warm_up_runs_before_the_engine_and_the_proof_is_still_timed():
    """``--warm-up``: one plain forward and backward before the engine, so the proof timed is the proof alone."""
    rows = max_model.main(["--tiny", "--layers", "1", "--modes", "dp,nonprivate", "--warm-up"])["rows"]
    assert all(row["warm_up"] and row["fits"] for row in rows)
    dp = next(row for row in rows if row["mode"] == "dp")
    assert dp["probe_seconds"] > 0 and dp["probe_steps"] > 0
    assert "warm_up" not in max_model.main(["--tiny", "--layers", "1", "--modes", "nonprivate"])["rows"][0]


def test_a_trial_killed_above_the_cap_does_not_fit(tmp_path):
    result = max_model.main(["--tiny", "--layers", "1", "--modes", "nonprivate", "--cap-gb", "0.01"])
    assert result["rows"][0]["fits"] is False and "cap" in result["rows"][0]["why"]
    assert result["largest"] == {}


def test_each_size_is_tried_in_every_mode_still_fitting_before_the_next(monkeypatch):
    # the first GPU run (H200): modes one after the other spent the scale step's whole time budget growing the
    # non-private model to 4B parameters, and DP never ran; now a cut-off run compares the modes at the same sizes
    tried = []

    def trial(mode, layers, args):
        tried.append((mode, layers))
        return {"mode": mode, "layers": layers, "fits": not (mode == "dp" and layers > 1), "parameters": layers}

    monkeypatch.setattr(max_model, "trial", trial)
    monkeypatch.setattr(max_model, "machine", lambda device: "test")
    result = max_model.main(["--tiny", "--layers", "1,2,3", "--modes", "nonprivate,dp"])
    assert tried == [("nonprivate", 1), ("dp", 1), ("nonprivate", 2), ("dp", 2), ("nonprivate", 3)]
    assert result["largest"] == {"nonprivate": {"layers": 3, "parameters": 3}, "dp": {"layers": 1, "parameters": 1}}


@pytest.mark.slow  # two torchrun jobs of 2 gloo ranks: ~1 min
def test_the_fsdp2_modes_train_on_two_ranks_with_the_proof_before_sharding(tmp_path):
    result = max_model.main(["--tiny", "--layers", "1", "--modes", "nonprivate-fsdp2,dp-fsdp2"])
    rows = {row["mode"]: row for row in result["rows"]}
    assert rows["nonprivate-fsdp2"]["fits"] and rows["dp-fsdp2"]["fits"]
    dp = rows["dp-fsdp2"]
    assert len(dp["rank_peak_bytes"]) == max_model.RANKS and dp["peak_bytes"] == max(dp["rank_peak_bytes"])
    assert dp["probe_seconds"] > 0 and dp["probe_peak_bytes"] > 0


def test_the_memory_watch_counts_every_descendant(tmp_path):
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                              "p = subprocess.Popen([sys.executable, '-c', 'import time; x = bytearray(300 << 20); "
                              "time.sleep(30)']); time.sleep(30)"])
    try:
        import time

        deadline = time.time() + 20
        while max_model.rss_of(child.pid) < 300 << 20 and time.time() < deadline:
            time.sleep(0.1)
        assert max_model.rss_of(child.pid) >= 300 << 20  # the grandchild's 300 MiB count
    finally:
        for pid in [child.pid]:
            subprocess.run(["pkill", "-P", str(pid)])
        child.kill()


def test_fsdp2_is_not_started_on_fewer_gpus_than_ranks(monkeypatch):
    # the second GPU run (one H200): both ranks started on the one GPU and failed, and the row's reason was
    # torchrun's '====' banner; now such a trial is not run and says why
    monkeypatch.setattr(max_model, "gpus", lambda: 1)
    monkeypatch.setattr(max_model.subprocess, "Popen", lambda *a, **k: pytest.fail("a trial was started"))
    args = max_model.argparse.Namespace(device="cuda", tiny=True, cap_gb=20.0, batch=2, length=32)
    row = max_model.trial("dp-fsdp2", 22, args)
    assert row["fits"] is None and "one GPU per rank" in row["why"] and "has 1" in row["why"]


def test_a_failed_childs_reason_is_its_last_error_line_not_torchruns_banner():
    stderr = ("Traceback (most recent call last):\n  File \"x.py\", line 1\ntorch.OutOfMemoryError: CUDA out of memory"
              "\n[rank1]: more\n============================================================\n")
    assert max_model.failure(stderr) == "torch.OutOfMemoryError: CUDA out of memory"
    assert max_model.failure("=====\n\n") == "no output"
