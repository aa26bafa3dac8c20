"""Canary sweep of what runs write (issue 25): every task type (DP-SGD and eDP-SGD), synth, the distill methods
(synthetic_only, dpkd, dp_sgd), decode (sampling and a sweep over private texts), `dptext models --check` and
`bench-memory` on a trained model, run tiny through the CLI; no canary may appear in a file outside the manifest's
not_covered entries, nor be printed.

The data and checks are in canary_cases.py; `dptext check`, `data`, `mia` (all attacks), a canary control code
(which `dptext synth` refuses by position) and a torchrun run are swept in test_canary_commands.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dptext import bench as benchmark

from canary_cases import (CANARY, CODES, RUNS, TEXT, TINY, build_data, canary_token_ids, cli, finetune,
                          run_arguments, scan_file, sweep)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    return build_data(tmp_path_factory.mktemp("canary-data"))


@pytest.mark.parametrize("name", sorted(RUNS))
def test_finetune_outputs_hold_no_canary_outside_not_covered(name, data, tmp_path, capsys):
    model = RUNS[name][1]
    run = finetune(capsys, tmp_path / name, *run_arguments(name, data))
    status = sweep(run, canary_token_ids(model))
    assert status["model/config.json"] in ("covered", "public") and status["result.json"] == "covered"
    shown = cli(capsys, "account", str(run))
    assert {f["path"] for f in shown["release"]["files"]} == set(status)
    if name == "classification":  # the audit folder holds the records: listed not covered, and the scan bites
        assert status["audit_not_private/members.jsonl"] == "not_covered"
        audit = b"".join(p.read_bytes() for p in (run / "audit_not_private").glob("*.jsonl"))
        assert any(c.encode() in audit for c in CANARY.values())  # the planted record is a member or held out
        cli(capsys, "mia", str(run))
        sweep(run, canary_token_ids(model))
    if name == "classification_edp":
        assert json.loads((run / "result.json").read_text())["privacy"]["method"] == "edp_sgd"
    if name.startswith("intent_slot"):
        labels = json.loads((run / "model" / "intent_slot_labels.json").read_text())
        assert labels["intents"] == ["flight", "fare", "other"]


def distill(capsys, tmp_path: Path, name: str, data: dict[str, Path], *overrides: str, **section) -> Path:
    recipe = tmp_path / f"{name}.yaml"
    recipe.write_text(json.dumps({"name": name, "distill": {"student_layers": [1], **section}}))
    out = tmp_path / name
    cli(capsys, "distill", str(recipe), *TINY, f"data.path={data['text']}", *TEXT, *CODES, *overrides,
        "--out", str(out))
    return out


def test_synth_distill_and_decode_hold_no_canary(data, tmp_path, capsys, monkeypatch):
    model = RUNS["language_modeling"][1]
    teacher = finetune(capsys, tmp_path / "teacher", *run_arguments("language_modeling", data))
    synthetic = tmp_path / "synthetic"
    synth = ["--n", "12", "--batch-size", "6", "--max-new-tokens", "4", "--validation-fraction", "0.25"]
    cli(capsys, "synth", str(teacher), "--out", str(synthetic), *synth, "--check-training-copies")
    ids = canary_token_ids(model)
    status = sweep(synthetic, ids)
    assert status["train.jsonl"] == "covered" and status["training_copies_not_private.json"] == "not_covered"
    # the code histogram's noise is secret: the same public --seed (written to plan.json) draws other noise
    cli(capsys, "synth", str(teacher), "--out", str(tmp_path / "again"), *synth)
    noisy = [json.loads((f / "plan.json").read_text())["distribution"]["noisy_counts"]
             for f in (synthetic, tmp_path / "again")]
    assert noisy[0] != noisy[1]
    students = {
        "synthetic_only": distill(capsys, tmp_path, "student", data, method="synthetic_only", teacher=str(teacher),
                                  synthetic=str(synthetic)),
        # DPKD on the private data: the teacher spent ε = 8 and δ = 1/(2n) of this total
        "dpkd": distill(capsys, tmp_path, "dpkd", data, "privacy.target_epsilon=16", "privacy.delta=0.1",
                        "privacy.allow_large_delta=true", method="dpkd", teacher=str(teacher)),
        "dp_sgd": distill(capsys, tmp_path, "dp_sgd", data, method="dp_sgd", student=model),
    }
    for method, student in students.items():
        sweep(student, ids)
        assert json.loads((student / "result.json").read_text())["method"] == method
    cli(capsys, "decode", "--model", str(teacher / "model"), "--prompt", "the food", "-T", "3", "--lambda", "0.5",
        "--seed", "1")
    plot = tmp_path / "sweep.png"  # a sweep over the private training texts: scores only, never the texts
    cli(capsys, "decode", "--model", str(teacher / "model"), "--data", str(data["text"] / "train.jsonl"),
        "--sweep", "0.5,1.0", "--max-length", "16", "--plot", str(plot))
    scan_file(plot, ids, "decode's sweep plot")
    # tools on the trained model: a forward pass, and memory benchmarks on synthetic token ids (no records)
    checked = cli(capsys, "models", "--check", str(teacher / "model"))
    assert checked["check"]["parameters"] > 0
    bench = tmp_path / "bench"
    # each mode in this process, not a fresh one (that isolation only sharpens the peak-memory figure)
    monkeypatch.setattr(benchmark, "_run_in_subprocess", lambda spec, env=None: benchmark.measure(spec))
    report = cli(capsys, "bench-memory", str(teacher / "model"), "--seq-len", "8", "--batch-size", "2", "--steps", "1",
        "--warmup", "0", "--modes", "bookkeeping", "--out", str(bench))
    assert [r["status"] for r in report["results"]] == ["ok"]
    written = [p for p in bench.rglob("*") if p.is_file()]
    assert written
    for path in written:
        scan_file(path, ids, f"bench-memory's {path.name}")

