"""benchmarks/collect_correlated.py: issue 47's utility table comes from finished runs only, each row with the ε its
own accountant proved, and committed rows survive the loss of their run folders."""

from __future__ import annotations

import json

from test_results_tables import _fake_run, _load

correlated = _load("collect_correlated")


def _run(folder, accuracy: float, mechanism: str | None, epsilon: float) -> None:
    _fake_run(folder, ser=0.0, validation=0.0, lr=1e-3)
    result = json.loads((folder / "result.json").read_text())
    result["metrics"]["accuracy"] = accuracy
    result["privacy"].update(accountant="rdp", epsilon={"rdp": {"epsilon": epsilon, "note": "RDP"}},
                             sampling="cyclic" if mechanism else "poisson", target_epsilon=8.0,
                             mechanism={"strategy_sensitivity": 1.4, "bands": 8, "randomness": "secret"})
    (folder / "result.json").write_text(json.dumps(result))
    privacy = f"privacy:\n  mechanism: {mechanism}\n" if mechanism else ""
    (folder / "resolved.yaml").write_text(f"train:\n  learning_rate: 0.001\n{privacy}")


def test_rows_come_from_finished_runs_and_say_which_mechanism_and_epsilon(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "correlated.json"
    _run(runs / "mf-quickstart-dp_sgd", 70.0, None, 7.99)
    _run(runs / "mf-quickstart-banded_mf", 73.5, "banded_mf", 8.0)
    (runs / "mf-quickstart-blt").mkdir()  # started, not finished: no row
    data = correlated.collect(runs, out)
    assert set(data) == {"quickstart", "e2e-cpu"} and set(data["quickstart"]) == {"dp_sgd", "banded_mf"}
    assert set(data["e2e-cpu"]) == {"dp_sgd"}  # the same recipe's earlier run (below)
    mf = data["quickstart"]["banded_mf"]
    assert (mf["mechanism"], mf["accuracy"], mf["epsilon"], mf["sampling"]) == ("banded_mf", 73.5, 8.0, "cyclic")
    assert mf["strategy"] == {"strategy_sensitivity": 1.4, "bands": 8}
    assert data["quickstart"]["dp_sgd"]["mechanism"] == "dp_sgd"
    text = correlated.table(data)
    assert "| quickstart | banded MF (cyclic) | accuracy 73.50 | 8.00 (1e-05) |" in text
    assert "| quickstart | BLT (cyclic) | not run yet |" in text
    assert "| e2e-cpu | BLT (cyclic) | not run yet |" in text


def test_a_committed_row_whose_run_is_gone_is_kept(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "correlated.json"
    _run(runs / "mf-sst2-blt", 81.0, "blt", 8.0)
    correlated.collect(runs, out)
    fresh = tmp_path / "fresh"
    _run(fresh / "mf-sst2-dp_sgd", 83.0, None, 8.0)
    data = correlated.collect(fresh, out)
    assert data["sst2"]["blt"]["accuracy"] == 81.0 and data["sst2"]["dp_sgd"]["accuracy"] == 83.0


def test_e2e_dp_sgd_comes_from_the_same_recipes_earlier_run_until_its_job_finishes(tmp_path):
    """E2E-CPU's DP-SGD job is recipes/e2e-cpu-dp.yaml unchanged: without a finished run of the job, its row is that
    recipe's committed run (results/e2e_cpu.json), said to be from an earlier commit; a finished run replaces it."""
    runs, out = tmp_path / "runs", tmp_path / "correlated.json"
    runs.mkdir()
    earlier = json.loads((correlated.RESULTS.parent / "e2e_cpu.json").read_text())["eps8"]
    row = correlated.collect(runs, out)["e2e-cpu"]["dp_sgd"]
    assert (row["bleu"], row["commit"], row["steps"]) == (earlier["bleu"], earlier["commit"], earlier["steps"])
    assert row["epsilon"] == earlier["epsilon"]["rdp"]["epsilon"] and row["recipe"] == "e2e-cpu-dp"
    assert "(earlier commit)" in correlated.table({"e2e-cpu": {"dp_sgd": row}})
    _run(runs / "mf-e2e-cpu-dp_sgd", 0.0, None, 7.9)
    result = json.loads((runs / "mf-e2e-cpu-dp_sgd" / "result.json").read_text())
    result["metrics"].update(bleu=50.0, rouge_l=60.0)
    (runs / "mf-e2e-cpu-dp_sgd" / "result.json").write_text(json.dumps(result))
    fresh = correlated.collect(runs, tmp_path / "other.json")["e2e-cpu"]["dp_sgd"]
    assert fresh["bleu"] == 50.0 and "source" not in fresh
