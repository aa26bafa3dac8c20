"""Issue 44's GPU check rehearsed on the CPU, so that it cannot rot between GPU runs.

Fast: the exactness step (benchmarks/gpu_exactness.py --tiny: every clipping mode in fp32 on GPT-2 and Llama
with padding, B = T and LoRA, and Llama under bf16 autocast and with bf16 weights) is exact or refused, and it
fails an engine whose sum is wrong in one layer; the collector's ratios, its scale rows from a cut-off log and
its refusal to file a rehearsal as GPU results. Slow (about two minutes on 2 cores, most of it bench-memory's
ten subprocesses): the whole script, ``benchmarks/device/gpu_check.sh --device cpu --tiny``, then the collector.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import collect_gpu  # noqa: E402  (benchmarks/ is not a package)
import gpu_exactness  # noqa: E402


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from a second thread, which only waits, on a busy 2-core machine for long."""
    threads = gpu_exactness.torch.get_num_threads()
    gpu_exactness.torch.set_num_threads(1)
    yield
    gpu_exactness.torch.set_num_threads(threads)


def test_the_tiny_exactness_cells_are_exact_on_the_cpu(tmp_path, one_thread):
    out = tmp_path / "exactness.json"
    assert gpu_exactness.main(["--device", "cpu", "--tiny", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    cells = report["cells"]
    assert len(cells) == report["setup"]["planned"] == len(gpu_exactness.TINY_CELLS)
    # plain decoders: nothing to refuse (the first GPU run's finding was a refusal: the fp32 probe, which the bf16
    # cells now run as real models do, compared inside the training's bf16 autocast)
    assert {c["outcome"] for c in cells} == {"exact"}, [c for c in cells if c["outcome"] != "exact"]
    assert {(c["mode"], c["precision"]) for c in cells} == {(m, p) for m in gpu_exactness.MODES
                                                           for p in gpu_exactness.PRECISIONS}
    for c in cells:
        if c["outcome"] == "exact":
            assert 0.5 < c["sensitivity_c"] <= 1 + gpu_exactness.TOLERANCE[c["precision"]]["sum"]
            assert ("error_vs_fp64" in c) == (c["precision"] != "fp32")


@pytest.mark.parametrize("precision", ["fp32", "bf16_weights"])
def test_a_layer_whose_clipped_sum_is_off_fails_its_cell(monkeypatch, precision, one_thread):
    """The brute-force twin is not vacuous: one parameter's sum scaled by 0.7 (a path half missed) fails."""
    right = gpu_exactness.clipped

    def one_layer_off(*args, **kwargs):
        norms, sums, proof_ran = right(*args, **kwargs)
        name = sorted(sums)[-1]
        return norms, {**sums, name: 0.7 * sums[name]}, proof_ran

    monkeypatch.setattr(gpu_exactness, "clipped", one_layer_off)
    cell = gpu_exactness.run_cell("llama", "default", "bookkeeping", precision, gpu_exactness.torch.device("cpu"))
    assert cell["outcome"] == "FAILED" and any(p.startswith("layer") for p in cell["problems"]), cell


def fake_out(folder: Path, device: str = "cpu", with_scale: bool = True) -> Path:
    """An $OUT as gpu_check.sh leaves it, with made-up numbers (the slow test below runs the real script)."""
    folder.mkdir()
    meta = {"device": device, "tiny": device == "cpu", "torch": "2.13.0", "provenance": {
        "git_revision": "abc1234", "packages": {"torch": "2.13.0"}}, "steps": {"exactness": {
            "status": "ok", "rc": 0, "seconds": 3.0, "limit_seconds": 90}}}
    if device == "cuda":
        meta.update(device_name="NVIDIA H100 80GB HBM3", cuda="13.0")
    rows = [("nonprivate", 0.10, 1000.0, 64), ("bookkeeping", 0.12, 1100.0, 60), ("ghost", 0.15, 1050.0, 62)]
    results = [{"mode": mode, "status": "ok", "step_s": step, "peak_mb": peak, "max_batch": largest,
                "time_ratio": step / 0.10, "memory_ratio": peak / 1000.0} for mode, step, peak, largest in rows]
    results += [{"mode": "opacus", "status": "unsupported: tied embeddings"},
                {"mode": "opacus_untied", "status": "ok", "step_s": 0.20, "peak_mb": 2000.0, "max_batch": 30,
                 "time_ratio": 2.0, "memory_ratio": 2.0}]
    setup = {"model": "smollm2-135m", "seq_len": 256, "batch_size": 8, "device": device, "precision": "bf16",
             "steps": 5, "warmup": 2, "rounds": 1, "machine": "test machine"}
    (folder / "meta.json").write_text(json.dumps(meta))
    (folder / "bench.json").write_text(json.dumps({"runs": [{"setup": setup, "results": results}]}))
    row = {"mode": "dp", "layers": 2, "parameters": 1000, "fits": True, "peak_bytes": 2**30, "step_seconds": 0.5,
           "probe_seconds": 1.0, "probe_steps": 2.0}
    log = ["== scale", json.dumps({**row, "mode": "nonprivate", "layers": 4, "parameters": 2000}), json.dumps(row),
           json.dumps({"mode": "dp", "layers": 4, "fits": False, "why": "CUDA out of memory"})]
    (folder / "log.txt").write_text("\n".join(log) + "\n")
    if with_scale:
        (folder / "max_model.json").write_text(json.dumps({"rows": [row], "largest": {"dp": {"layers": 2,
                                                                                            "parameters": 1000}}}))
    return folder


def test_the_collector_gives_ratios_to_non_private_and_to_opacus(tmp_path, capsys):
    out = fake_out(tmp_path / "out", device="cuda")
    assert collect_gpu.main([str(out), "--out", str(tmp_path / "bench_gpu.json")]) == 0
    result = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert result["device"] == "NVIDIA H100 80GB HBM3" and result["commit"] == "abc1234" and not result["rehearsal"]
    rows = {row["mode"]: row for row in result["bench"][0]["results"]}
    assert rows["bookkeeping"]["opacus_reference"] == "opacus_untied"  # opacus itself refused the tied model
    assert rows["bookkeeping"]["opacus_time_ratio"] == pytest.approx(0.6)
    assert rows["bookkeeping"]["opacus_memory_ratio"] == pytest.approx(0.55)
    assert "opacus_time_ratio" not in rows["opacus"]
    printed = capsys.readouterr().out
    assert "NVIDIA H100 80GB HBM3" in printed and "| dptext book-keeping | 0.120 | 1.20 | 0.60 |" in printed


def test_a_cut_off_scale_step_is_read_from_the_log(tmp_path):
    result = collect_gpu.collect(fake_out(tmp_path / "out", with_scale=False))
    assert result["scale"]["from_log"] and len(result["scale"]["rows"]) == 3
    assert result["scale"]["largest"] == {"nonprivate": {"layers": 4, "parameters": 2000},
                                          "dp": {"layers": 2, "parameters": 1000}}


def test_a_later_partial_run_replaces_only_the_parts_it_ran(tmp_path, capsys):
    # the first GPU run (H200) had no time for two of its bench steps nor the scale step's DP rows; a later session
    # runs only those (gpu_check.sh --only) and the collector merges, each table still from one run and one device
    first = fake_out(tmp_path / "first", device="cuda")
    tolerance = {"fp32": dict.fromkeys(("norms", "sum", "layer"), 1e-4)}
    (first / "exactness.json").write_text(json.dumps({"setup": {"tolerance": tolerance, "planned": 1}, "cells": [
        {"arch": "gpt2", "situation": "default", "mode": "ghost", "precision": "fp32", "outcome": "refused"}]}))
    later = fake_out(tmp_path / "later", device="cuda")
    meta = json.loads((later / "meta.json").read_text())
    meta["provenance"]["git_revision"] = "def5678"
    meta["steps"] = {"scale": {"status": "ok", "rc": 0, "seconds": 9.0, "limit_seconds": 200}}
    (later / "meta.json").write_text(json.dumps(meta))
    report = json.loads((later / "bench.json").read_text())
    report["runs"][0]["setup"]["seq_len"] = 1024
    (later / "bench.json").write_text(json.dumps(report))
    assert collect_gpu.main([str(first), str(later), "--out", str(tmp_path / "bench_gpu.json")]) == 0
    result = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert [bench["setup"]["seq_len"] for bench in result["bench"]] == [256, 1024]
    assert result["exactness"]["summary"]["refused"] == 1  # the later run had no exactness step: the first's stays
    assert {name: stamp["commit"] for name, stamp in result["parts"].items()} == {
        "exactness": "abc1234", "bench-T256-B8": "abc1234", "bench-T1024-B8": "def5678", "scale": "def5678"}
    assert set(result["steps"]) == {"exactness", "scale"} and result["commit"] == "def5678"
    assert "Merged runs, each part from one: exactness: NVIDIA H100 80GB HBM3 at abc1234" in capsys.readouterr().out


def test_scale_rows_of_one_commit_and_device_are_added_together(tmp_path, capsys):
    # the second GPU run: the check's scale step reached 66 layers, two more calls on the same machine ran 120-165
    # (max_model.py --layers ..., a folder with only its max_model.json); one table of every size measured
    first = fake_out(tmp_path / "first", device="cuda")
    later = fake_out(tmp_path / "later", device="cuda")
    more = tmp_path / "more"
    more.mkdir()
    big = {"mode": "dp", "layers": 8, "parameters": 4000, "fits": True, "peak_bytes": 2**31, "step_seconds": 1.0,
           "probe_seconds": 3.0, "probe_steps": 3.0}
    (more / "max_model.json").write_text(json.dumps({"rows": [big, {"mode": "nonprivate", "layers": 8,
                                                                    "fits": False, "why": "=" * 60}]}))
    assert collect_gpu.main([str(first), str(later), str(more), "--out", str(tmp_path / "bench_gpu.json")]) == 0
    result = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert [(row["mode"], row["layers"]) for row in result["scale"]["rows"]] == [("dp", 2), ("dp", 8),
                                                                                  ("nonprivate", 8)]
    assert result["scale"]["largest"] == {"dp": {"layers": 8, "parameters": 4000}}
    assert result["commit"] == "abc1234" and not result["rehearsal"]
    assert "its ranks failed to start" in capsys.readouterr().out  # not torchrun's banner
    assert collect_gpu.main([str(more), "--out", str(tmp_path / "x.json")]) == 2  # alone: not a check's $OUT


def test_the_opt_in_finetune_run_is_collected_with_its_epsilon_and_micro_batch(tmp_path, capsys):
    out = fake_out(tmp_path / "out", device="cuda")
    (out / "finetune").mkdir()
    (out / "finetune" / "result.json").write_text(json.dumps({
        "model": "smollm2-135m", "task": "table_to_text", "metrics": {"bleu": 0.5}, "steps_run": 4,
        "physical_batch_size": 64, "dataset_size": 512, "privacy": {
            "accountant": "rdp", "epsilon": {"rdp": {"epsilon": 7.99}}, "delta": 1 / 1024,
            "expected_batch_size": 128.0, "clipping_mode": "bookkeeping"}}))
    (out / "finetune" / "metrics.jsonl").write_text("\n".join(json.dumps({"step": i}) for i in (1, 2, 3, 4)))
    assert collect_gpu.main([str(out), "--out", str(tmp_path / "bench_gpu.json")]) == 0
    run = json.loads((tmp_path / "bench_gpu.json").read_text())["finetune"]
    assert (run["epsilon"], run["physical_batch_size"], run["steps"], run["training_records"]) == (7.99, 64, 4, 4)
    assert "micro-batch 64 (left to dptext), ε = 7.99" in capsys.readouterr().out


def test_a_rehearsal_is_not_filed_as_gpu_results(tmp_path, capsys):
    out = fake_out(tmp_path / "out", device="cpu")
    before = collect_gpu.RESULT.read_bytes() if collect_gpu.RESULT.exists() else None
    assert collect_gpu.main([str(out)]) == 2
    message = capsys.readouterr().err.strip()
    assert "rehearsal" in message and "--out" in message and "\n" not in message
    assert (collect_gpu.RESULT.read_bytes() if collect_gpu.RESULT.exists() else None) == before


def test_the_step_profile_rehearsed_on_the_cpu(tmp_path):
    # for the next GPU session: the first run measured book-keeping at 2.34x non-private on the H200, 1.24x here
    sys.path.insert(0, str(ROOT / "benchmarks" / "device"))
    import profile_step

    out = tmp_path / "profile.json"
    result = profile_step.main(["--device", "cpu", "--model", "tiny-llama", "--seq-len", "8", "--batch-size", "2",
                                "--steps", "1", "--modes", "nonprivate,bookkeeping", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    rows = {row["mode"]: row for row in result["rows"]}
    assert set(rows) == {"nonprivate", "bookkeeping"}
    assert all(row["wall_s"] > 0 and row["ops_per_step"] > 0 and row["top_cpu"] for row in rows.values())
    assert rows["bookkeeping"]["ops_per_step"] > rows["nonprivate"]["ops_per_step"]


@pytest.mark.slow
def test_the_whole_check_rehearsed_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "benchmarks/device/gpu_check.sh"), "--device", "cpu", "--tiny"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(path.name for path in out.iterdir()) == ["bench.json", "exactness.json", "log.txt",
                                                           "max_model.json", "meta.json"]
    meta = json.loads((out / "meta.json").read_text())
    assert set(meta["steps"]) == {"exactness", "bench-T16-B2", "scale"}
    assert all(step["status"] == "ok" for step in meta["steps"].values()), meta["steps"]
    assert subprocess.run([sys.executable, str(ROOT / "benchmarks/collect_gpu.py"), str(out)],
                          capture_output=True, text=True).returncode == 2  # not into benchmarks/results/
    collected = tmp_path / "bench_gpu.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/collect_gpu.py"), str(out), "--out",
                           str(collected)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    result = json.loads(collected.read_text())
    summary = result["exactness"]["summary"]
    assert summary["cells"] == summary["planned"] == len(gpu_exactness.TINY_CELLS) and summary["FAILED"] == 0
    assert summary["exact"] + summary["refused"] == summary["cells"]
    [report] = result["bench"]
    assert report["setup"]["model"] == "tiny-llama" and report["setup"]["precision"] == "bf16"
    rows = {row["mode"]: row for row in report["results"]}
    assert set(rows) == {"nonprivate", "bookkeeping", "ghost", "opacus", "opacus_untied"}
    assert all(rows[mode]["status"] == "ok" and rows[mode]["step_s"] > 0 for mode in ("nonprivate", "bookkeeping",
                                                                                       "ghost"))
    assert set(result["scale"]["largest"]) == {"nonprivate", "dp"}
    assert "| dptext book-keeping |" in done.stdout and "Exactness" in done.stdout
