"""benchmarks/collect_results.py and results_tables.py: docs/results.md's tables are what benchmarks/results/ says."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
from scipy.stats import norm

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


tables = _load("results_tables")
collect = _load("collect_results")


def test_readme_block_matches_the_result_files():
    generated = tables.render(collect.load_results())
    assert tables.readme_block(ROOT / "docs" / "results.md") == generated, (
        "docs/results.md tables are stale: run `python benchmarks/collect_results.py readme`")


def test_missing_entries_show_as_running_never_as_numbers():
    text = tables.render({"atis": {}})
    atis = [line for line in text.splitlines() if line.startswith("| non-private")]
    assert atis and all("running" in line for line in atis)


def test_pld_epsilon_of_unsampled_gaussians_matches_the_exact_gaussian_curve():
    # q = 1: S Gaussian steps of multiplier σ are one Gaussian with μ = √S/σ, whose exact
    # δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Balle & Wang); PLD must be that, up to its
    # (pessimistic) grid.
    sigma, steps, delta = 2.0, 16, 1e-5
    eps = collect.epsilon_pld({"delta": delta, "runs": [{"sample_rate": 1.0, "noise_multiplier": sigma,
                                                          "steps": steps}]})
    mu = math.sqrt(steps) / sigma
    exact_delta = norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)
    assert exact_delta <= delta and exact_delta == pytest.approx(delta, rel=0.02)


def test_timing_sums_resumed_invocations_and_skips_evaluation_intervals():
    metrics = [
        {"step": 10, "seconds": 10.0}, {"step": 20, "seconds": 20.0},
        {"step": 20, "split": "validation"},  # the interval 20 -> 30 holds an evaluation: not training time
        {"step": 30, "seconds": 90.0},
        {"step": 40, "seconds": 5.0}, {"step": 50, "seconds": 15.0},  # resumed: the clock restarted
    ]
    clock = collect.timing(metrics, steps_per_epoch=100)
    assert clock["invocations"] == 2 and clock["train_seconds"] == 90.0 + 15.0
    assert clock["seconds_per_epoch"] == pytest.approx((10 + 10) / 20 * 100)


def _fake_run(folder: Path, ser: float, validation: float, lr: float, private: bool = True) -> None:
    folder.mkdir(parents=True)
    privacy = {"private": private, "sample_rate": 0.1, "expected_batch_size": 10.0, "dataset_size": 100, "steps": 20}
    if private:
        privacy.update(epsilon={"rdp": {"epsilon": 8.0}}, delta=1e-5, noise_multiplier=1.0, max_grad_norm=0.1)
        (folder / "ledger.json").write_text(json.dumps(
            {"delta": 1e-5, "runs": [{"sample_rate": 0.1, "noise_multiplier": 1.0, "steps": 20}]}))
    result = {"recipe": "r", "eval_split": "test", "seconds": 12.0, "steps_run": 20, "privacy": privacy,
              "metrics": {"ser": ser, "intent_acc": 90.0, "slot_f1": 80.0},
              "selection": {"metric": "ser", "best_value": validation}}
    (folder / "result.json").write_text(json.dumps(result))
    (folder / "provenance.json").write_text(json.dumps({"platform": "p", "machine": "m", "git_revision": "abc"}))
    (folder / "metrics.jsonl").write_text('{"step": 10, "seconds": 1.0}\n{"step": 20, "seconds": 2.0}\n')
    (folder / "resolved.yaml").write_text(f"train:\n  learning_rate: {lr}\n")


def test_the_clock_comes_from_the_diagnostics_file_where_runs_now_write_it(tmp_path):
    """Since the release registry, per-step seconds go to the not-covered diagnostics file, not metrics.jsonl: a
    collector reading only metrics.jsonl reported 0 training seconds and the last invocation's time as the wall."""
    folder = tmp_path / "run"
    _fake_run(folder, ser=5.0, validation=6.0, lr=1e-3)
    (folder / "metrics.jsonl").write_text('{"step": 10, "epsilon": 1.0}\n{"step": 20, "epsilon": 2.0}\n'
                                          '{"step": 20, "split": "test", "ser": 5.0}\n')
    (folder / "diagnostics_not_private.jsonl").write_text(  # two invocations: the second resumed from step 10
        '{"step": 10, "loss": 1.0, "seconds": 30.0}\n{"step": 20, "loss": 0.9, "seconds": 25.0}\n')
    row = collect.entry(folder, {"ser": "ser"})
    assert row["invocations"] == 2 and row["train_seconds"] == 30.0 + 25.0
    assert row["wall_seconds"] == 30.0 + 12.0  # earlier invocations' logged time + the last one's whole time


def test_the_wall_time_comes_from_the_diagnostics_finished_record_not_result_json(tmp_path):
    """Runs no longer put their total seconds into the covered result.json (a timing side channel)."""
    folder = tmp_path / "run"
    _fake_run(folder, ser=5.0, validation=6.0, lr=1e-3)
    result = json.loads((folder / "result.json").read_text())
    del result["seconds"]
    (folder / "result.json").write_text(json.dumps(result))
    (folder / "metrics.jsonl").write_text('{"step": 20, "split": "test", "ser": 5.0}\n')
    (folder / "diagnostics_not_private.jsonl").write_text(
        '{"step": 10, "loss": 1.0, "seconds": 30.0}\n{"step": 20, "loss": 0.9, "seconds": 25.0}\n'
        '{"event": "finished", "step": 20, "total_seconds": 40.0}\n')
    row = collect.entry(folder, {"ser": "ser"})
    assert row["train_seconds"] == 30.0 + 25.0 and row["wall_seconds"] == 30.0 + 40.0


def test_an_invocation_that_only_evaluated_adds_to_the_earlier_training_time(tmp_path):
    """A run stopped during its final evaluation and resumed at its last step logs no step in the last invocation:
    the wall time is all the logged training time plus that invocation's whole time (it once reported only the
    evaluation's 131 s for E2E's non-private run)."""
    folder = tmp_path / "run"
    _fake_run(folder, ser=5.0, validation=6.0, lr=1e-3)
    (folder / "metrics.jsonl").write_text('{"step": 20, "split": "test", "ser": 5.0}\n')
    (folder / "diagnostics_not_private.jsonl").write_text(
        '{"step": 10, "loss": 1.0, "seconds": 30.0}\n{"step": 20, "loss": 0.9, "seconds": 55.0}\n'
        '{"event": "finished", "step": 20, "start_step": 20, "total_seconds": 40.0}\n')
    row = collect.entry(folder, {"ser": "ser"})
    assert row["wall_seconds"] == 55.0 + 40.0
    (folder / "diagnostics_not_private.jsonl").write_text(  # resumed at 10, trained to 20 in the last invocation
        '{"step": 10, "loss": 1.0, "seconds": 30.0}\n{"step": 20, "loss": 0.9, "seconds": 25.0}\n'
        '{"event": "finished", "step": 20, "start_step": 10, "total_seconds": 40.0}\n')
    assert collect.entry(folder, {"ser": "ser"})["wall_seconds"] == 30.0 + 40.0
    (folder / "diagnostics_not_private.jsonl").write_text(  # cut during its final evaluation, 12 s of it journaled
        '{"step": 10, "loss": 1.0, "seconds": 30.0}\n{"step": 20, "loss": 0.9, "seconds": 55.0}\n'
        '{"event": "finished", "step": 20, "start_step": 20, "total_seconds": 40.0, '
        '"evaluation_reused_seconds": 12.0}\n')
    assert collect.entry(folder, {"ser": "ser"})["wall_seconds"] == 55.0 + 40.0 + 12.0


def test_an_entry_says_which_arithmetic_the_run_trained_in(tmp_path):
    """``train.precision: auto`` is bf16 on a GPU and fp32 on a CPU, and results move with it: the entry says which."""
    folder = tmp_path / "run"
    _fake_run(folder, ser=5.0, validation=6.0, lr=1e-3)
    assert collect.entry(folder, {"ser": "ser"})["precision"] == "fp32"  # auto (the default) on a CPU
    provenance = {"platform": "p", "machine": "m", "git_revision": "abc", "accelerator": "NVIDIA H100, CUDA 13.0"}
    (folder / "provenance.json").write_text(json.dumps(provenance))
    assert collect.entry(folder, {"ser": "ser"})["precision"] == "bf16"  # auto on a GPU
    (folder / "resolved.yaml").write_text("train:\n  learning_rate: 0.001\n  precision: fp32\n")
    assert collect.entry(folder, {"ser": "ser"})["precision"] == "fp32"  # pinned, as the GPU job lines do


def test_search_waits_for_every_candidate_then_picks_on_validation_not_test(tmp_path, monkeypatch):
    runs, out = tmp_path / "runs", tmp_path / "results"
    first, *others = collect.FILES["atis"][1]["dp_sgd_eps8"]
    assert first == "atis-dpsgd-eps8-lr5e-4" and others
    _fake_run(runs / first, ser=20.0, validation=30.0, lr=5e-4)
    assert "atis" not in collect.collect(runs, out)  # the other candidates have not finished: no entry yet
    for k, name in enumerate(others):  # better on test, worse on validation
        _fake_run(runs / name, ser=10.0, validation=35.0 + k, lr=2e-3 * (k + 1))
    _fake_run(runs / "atis-nonprivate", ser=5.0, validation=6.0, lr=1e-4, private=False)
    atis = collect.collect(runs, out)["atis"]
    assert set(atis) == {"nonprivate", "dp_sgd_eps8"}
    chosen = atis["dp_sgd_eps8"]
    assert chosen["run"] == "atis-dpsgd-eps8-lr5e-4" and chosen["ser"] == 20.0
    validation = [c["validation_ser"] for c in chosen["search"]["candidates"]]
    assert validation == [30.0] + [35.0 + k for k in range(len(others))]
    assert chosen["epsilon_rdp"] == 8.0 and chosen["epsilon_pld"] < chosen["epsilon_rdp"]
    assert atis["nonprivate"]["epsilon_rdp"] is None and atis["nonprivate"]["commit"] == "abc"
    assert json.loads((out / "atis.json").read_text()) == json.loads(json.dumps(atis))
    text = tables.render({"atis": atis})
    assert "| DP-SGD, ε = 8 | 20.00 |" in text and "| eDP-SGD, ε = 8 | running |" in text


def _fake_accuracy_run(folder: Path, accuracy: float, lr: str) -> None:
    _fake_run(folder, ser=0.0, validation=0.0, lr=float(lr))
    result = json.loads((folder / "result.json").read_text())
    result["metrics"]["accuracy"] = accuracy
    (folder / "result.json").write_text(json.dumps(result))


def test_sst2_reports_the_final_run_at_the_rate_its_tuning_runs_chose(tmp_path):
    """The SST-2 learning rate is chosen on tuning runs (a split held out of train), never on the reported split."""
    runs, out = tmp_path / "runs", tmp_path / "results"
    tuned = collect.FILES["sst2"][1]["eps8"]
    assert tuned.learning_rates == ("5e-4", "1e-3", "2e-3") and tuned.tuning == "sst2-tune3-lr{lr}"
    for lr, tuning_accuracy in zip(tuned.learning_rates, (80.0, 84.0, 82.0)):
        _fake_accuracy_run(runs / tuned.tuning.format(lr=lr), tuning_accuracy, lr)
    for lr, reported in (("5e-4", 95.0), ("2e-3", 90.0)):  # better on the reported split, but not chosen
        _fake_accuracy_run(runs / tuned.final.format(lr=lr), reported, lr)
    assert "eps8" not in collect.collect(runs, out).get("sst2", {})  # the chosen rate's final run is not done
    _fake_accuracy_run(runs / tuned.final.format(lr="1e-3"), 85.0, "1e-3")
    chosen = collect.collect(runs, out)["sst2"]["eps8"]
    assert chosen["run"] == "sst2-eps8-lr1e-3" and chosen["accuracy"] == 85.0
    assert [c["tuning_accuracy"] for c in chosen["search"]["candidates"]] == [80.0, 84.0, 82.0]


def test_a_final_run_whose_tuning_runs_were_lost_is_chosen_by_the_committed_search(tmp_path):
    """The machine lost SST-2's tuning runs after the ε = 8 row was committed; the ε = 3 run at the rate they chose
    finished later and must be collected by the scores the committed search recorded, never by its own accuracy."""
    runs, out = tmp_path / "runs", tmp_path / "results"
    tuned = collect.FILES["sst2"][1]["eps8"]
    for lr, tuning_accuracy in zip(tuned.learning_rates, (80.0, 84.0, 82.0)):
        _fake_accuracy_run(runs / tuned.tuning.format(lr=lr), tuning_accuracy, lr)
    _fake_accuracy_run(runs / tuned.final.format(lr="1e-3"), 85.0, "1e-3")
    collect.collect(runs, out)
    fresh = tmp_path / "fresh"  # no tuning runs; ε = 3 at the chosen rate and, better but not chosen, at 2e-3
    eps3 = collect.FILES["sst2"][1]["eps3"]
    _fake_accuracy_run(fresh / eps3.final.format(lr="1e-3"), 83.0, "1e-3")
    _fake_accuracy_run(fresh / eps3.final.format(lr="2e-3"), 99.0, "2e-3")
    sst2 = collect.collect(fresh, out)["sst2"]
    assert sst2["eps3"]["run"] == "sst2-eps3-lr1e-3" and sst2["eps3"]["accuracy"] == 83.0
    assert [c["tuning_accuracy"] for c in sst2["eps3"]["search"]["candidates"]] == [80.0, 84.0, 82.0]
    assert sst2["eps8"]["accuracy"] == 85.0  # kept from the committed file


def test_an_entry_whose_runs_are_absent_keeps_its_committed_value(tmp_path):
    """A fresh machine has no run directories: collecting there must not erase results that were committed."""
    runs, out = tmp_path / "runs", tmp_path / "results"
    _fake_run(runs / "atis-nonprivate", ser=5.0, validation=6.0, lr=1e-4, private=False)
    collect.collect(runs, out)
    committed = json.loads((out / "atis.json").read_text())
    fresh = tmp_path / "fresh-runs"
    for k, name in enumerate(collect.FILES["atis"][1]["dp_sgd_eps8"]):
        _fake_run(fresh / name, ser=20.0 - k, validation=30.0 + k, lr=5e-4 * (k + 1))
    atis = collect.collect(fresh, out)["atis"]
    assert list(atis) == ["nonprivate", "dp_sgd_eps8"] and atis["nonprivate"] == committed["nonprivate"]
    _fake_run(fresh / "atis-nonprivate", ser=4.0, validation=5.0, lr=1e-4, private=False)  # a re-run replaces it
    assert collect.collect(fresh, out)["atis"]["nonprivate"]["ser"] == 4.0


def test_every_run_a_table_waits_for_is_in_the_job_list():
    """A grid grown in collect_results.py without its job in jobs.txt would leave its row "running" for ever."""
    jobs = (BENCHMARKS / "jobs.txt").read_text()
    named = {line.lstrip("#").split()[0] for line in jobs.splitlines() if line.lstrip("#").strip()}
    for _, entries in collect.FILES.values():
        for candidates in entries.values():
            if isinstance(candidates, collect.Tuned):
                continue  # its final run's name is decided by the search (an @search line)
            missing = [name for name in candidates if name not in named]
            assert not missing, f"{missing} in collect_results.FILES but not in benchmarks/jobs.txt"
    import collect_distill  # collect_results put benchmarks/ on the path

    chain = [f"{collect.DISTILL_CHAIN}/{folder}" for folder in [*collect_distill.FOLDERS.values(), "synthetic"]]
    assert not [name for name in chain if name not in named], "a DistilDP row's run is not in benchmarks/jobs.txt"


def test_distill_entries_come_from_the_chain_folder_and_committed_ones_are_kept(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "results"
    runs.mkdir()
    assert "distill" not in collect.collect(runs, out) and not (out / "distill.json").exists()
    out.mkdir()
    committed = {"teacher_eps2": {"model": "m", "epsilon": 2.0, "delta": 1e-4, "test_perplexity": 30.0, "steps": 64,
                                  "wall_seconds": 3600.0, "commit": "abc", "machine": "x"}}
    (out / "distill.json").write_text(json.dumps(committed))
    assert collect.collect(runs, out)["distill"] == committed
    text = tables.render({"distill": committed})
    assert "| teacher, DP-SGD | m | 2 | 0.0001 | 30 | 64 | 1.0 |" in text and "| zero-shot student | running |" in text


def _fake_synthetic(folder: Path, summary_status: str) -> None:
    folder.mkdir(parents=True)
    files = {"provenance.json": {"privacy": {"epsilon": 2.1}, "code_distribution": {}, "generation": {}},
             "summary.json": {"n": 4, "splits": {"train": 3, "validation": 1}, "code_coverage": {"per_code": {}},
                              "length_tokens": {}, "exact_duplicate_rate": 0.0},
             "training_copies_not_private.json": {"count": 1, "rate": 0.25}}
    for name, data in files.items():
        (folder / name).write_text(json.dumps(data))
    statuses = {"provenance.json": "covered", "summary.json": summary_status,
                "training_copies_not_private.json": "not_covered"}
    (folder / "release.json").write_text(json.dumps({"files": [{"path": p, "status": s} for p, s in statuses.items()]}))


def test_the_synthetic_entry_publishes_nothing_the_release_registry_calls_not_covered(tmp_path):
    import collect_distill  # collect_results put benchmarks/ on the path

    _fake_synthetic(tmp_path / "covered", "covered")
    entry = collect_distill.synthetic_entry(tmp_path / "covered")
    assert entry["n"] == 4 and "training_copies" not in entry and "per_code" not in entry["code_coverage"]
    _fake_synthetic(tmp_path / "exact", "not_covered")  # synth --codes exact
    with pytest.raises(SystemExit, match="summary.json not covered"):
        collect_distill.synthetic_entry(tmp_path / "exact")
    _fake_synthetic(tmp_path / "unlisted", "covered")  # a registry that does not list it counts as not covered
    release = json.loads((tmp_path / "unlisted" / "release.json").read_text())
    release["files"] = [f for f in release["files"] if f["path"] != "summary.json"]
    (tmp_path / "unlisted" / "release.json").write_text(json.dumps(release))
    with pytest.raises(SystemExit, match="summary.json not covered"):
        collect_distill.synthetic_entry(tmp_path / "unlisted")
    (tmp_path / "unlisted" / "release.json").unlink()
    with pytest.raises(SystemExit, match="has no release.json"):
        collect_distill.synthetic_entry(tmp_path / "unlisted")
