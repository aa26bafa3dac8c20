"""`dptext bench-memory` end to end on tiny-gpt2 (few steps), and the ratio arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dptext import bench as bench_module
from dptext.bench import MEMORY_ENV, add_ratios


def test_ratios_are_relative_to_the_non_private_run():
    results = [{"mode": "nonprivate", "status": "ok", "step_s": 2.0, "peak_mb": 100.0, "step_mb": 10.0},
               {"mode": "bookkeeping", "status": "ok", "step_s": 3.0, "peak_mb": 110.0, "step_mb": 20.0},
               {"mode": "opacus", "status": "unsupported: tied weights"}]
    add_ratios(results)
    assert results[1]["time_ratio"] == 1.5 and results[1]["memory_ratio"] == pytest.approx(1.1)
    assert results[1]["step_memory_ratio"] == 2.0 and "time_ratio" not in results[2]


def test_the_clock_runs_under_the_allocator_defaults_and_memory_in_its_own_subprocess(monkeypatch):
    calls = []

    def fake_subprocess(spec, env=None):
        calls.append((spec, env))
        peak = 100.0 if env == MEMORY_ENV else 130.0  # the default allocator keeps fragmentation in the RSS
        return {"mode": spec["mode"], "status": "ok", "step_s": 1.0, "times_s": [1.0] * spec["steps"],
                "peak_mb": peak, "step_mb": peak - 50}

    monkeypatch.setattr(bench_module, "_run_in_subprocess", fake_subprocess)
    spec = {"mode": "bookkeeping", "device": "cpu", "steps": 3, "warmup": 2, "max_batch": False}
    first = bench_module.measure_mode(spec, with_memory=True)
    assert [env for _, env in calls] == [None, MEMORY_ENV] and calls[1][0]["steps"] == 1
    assert first["peak_mb"] == 100.0 and first["step_mb"] == 50.0 and first["peak_mb_timed_run"] == 130.0
    later = bench_module.measure_mode(spec, with_memory=False)
    assert len(calls) == 3 and "peak_mb" not in later and "step_mb" not in later
    merged = bench_module.merge_rounds([first, later])
    assert merged["peak_mb"] == 100.0 and merged["peak_mb_timed_run"] == 130.0
    assert len(merged["times_s"]) == 6


def test_a_failed_memory_subprocess_fails_the_mode(monkeypatch):
    def fake_subprocess(spec, env=None):
        if env == MEMORY_ENV:
            return {"mode": spec["mode"], "status": "failed: killed"}
        return {"mode": spec["mode"], "status": "ok", "step_s": 1.0, "times_s": [1.0], "peak_mb": 1.0}

    monkeypatch.setattr(bench_module, "_run_in_subprocess", fake_subprocess)
    result = bench_module.measure_mode({"mode": "ghost", "device": "cpu", "steps": 1}, with_memory=True)
    assert result["status"] == "failed: killed"


@pytest.mark.integration
def test_bench_memory_cli_on_tiny_gpt2(tmp_path):
    pytest.importorskip("matplotlib")
    proc = subprocess.run(
        [sys.executable, "-m", "dptext", "bench-memory", "tiny-gpt2", "--seq-len", "8", "--batch-size", "2",
         "--steps", "1", "--warmup", "0", "--device", "cpu", "--modes", "nonprivate,bookkeeping,opacus",
         "--out", str(tmp_path), "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    rows = {r["mode"]: r for r in report["results"]}
    assert rows["nonprivate"]["time_ratio"] == 1.0
    assert rows["bookkeeping"]["status"] == "ok" and rows["bookkeeping"]["peak_mb"] > 0
    assert rows["bookkeeping"]["time_ratio"] > 0 and rows["bookkeeping"]["memory_ratio"] > 0
    # the Gaussian noise is timed inside the step (one draw per coordinate), never longer than the step
    assert 0 < rows["bookkeeping"]["noise_s"] < rows["bookkeeping"]["step_s"] and "noise_s" not in rows["nonprivate"]
    if "opacus" in rows and not rows["opacus"]["status"].startswith("failed"):
        assert rows["opacus"]["status"].startswith(("ok", "unsupported"))
    assert report["setup"]["seq_len"] == 8 and "CPU cores" in report["setup"]["machine"]
    assert json.loads((tmp_path / "bench.json").read_text())["setup"] == report["setup"]
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_memory_measures_the_correlated_noise_mechanisms(tmp_path):
    """banded_mf and blt: book-keeping with their noise (issue 47), timed and measured like the other modes."""
    proc = subprocess.run(
        [sys.executable, "-m", "dptext", "bench-memory", "tiny-gpt2", "--seq-len", "8", "--batch-size", "2",
         "--steps", "1", "--warmup", "3", "--device", "cpu", "--modes", "bookkeeping,banded_mf,blt",
         "--out", str(tmp_path), "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = {r["mode"]: r for r in json.loads(proc.stdout)["results"]}
    for mode in ("banded_mf", "blt"):
        assert rows[mode]["status"] == "ok" and rows[mode]["peak_mb"] > 0, rows[mode]
        assert 0 < rows[mode]["noise_s"] < rows[mode]["step_s"]


def test_unknown_mode_is_one_sentence_error():
    proc = subprocess.run([sys.executable, "-m", "dptext", "bench-memory", "tiny-gpt2", "--modes", "fast"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Unknown mode(s) fast" in proc.stderr


def test_a_run_where_every_mode_failed_exits_non_zero_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from dptext import bench
    from dptext.cli.app import main

    failed = [{"mode": mode, "status": "failed: RuntimeError: out of memory"} for mode in ("nonprivate", "ghost")]
    monkeypatch.setattr(bench, "run", lambda *args, **kwargs: {
        "setup": {"model": "tiny-gpt2", "seq_len": 8, "batch_size": 2, "device": "cpu", "precision": "fp32",
                  "steps": 1, "rounds": 1, "machine": "test"}, "results": failed})
    monkeypatch.delenv("DPTEXT_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["bench-memory", "tiny-gpt2", "--modes", "nonprivate,ghost", "--out", str(tmp_path / "out")])
    assert (exit_.value.code == 2
            and "No mode could be measured (nonprivate: failed: RuntimeError" in capsys.readouterr().err)
    assert not (tmp_path / "out").exists()
