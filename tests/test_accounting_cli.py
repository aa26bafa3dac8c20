"""`dptext account`: every form of the command, its JSON, its plot and its one-sentence errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dptext.accounting.ledger import PrivacyLedger
from dptext.cli.app import main
from dptext.config import load_recipe
from dptext.runs import RunDir


def account(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["account", *args])
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def account_json(capsys, *args: str) -> dict:
    code, out, err = account(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)


def by_method(document: dict) -> dict[str, dict]:
    return {r["method"]: r for r in document["results"]}


def test_epsilon_from_sigma_prints_the_reference_values(capsys):
    code, out, _ = account(capsys, "--sigma", "1.0", "--sample-rate", "0.01", "--steps", "1000", "--delta", "1e-5")
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] in (["RDP"], ["PRV"], ["GDP"])}
    assert lines["RDP"].split()[1] == "2.101"
    assert lines["PRV"].split()[1:4] == ["1.828", "1.778", "1.878"]
    assert lines["GDP"].split()[2] == "1.618" and "approximation" in lines["GDP"]


def test_epsilon_from_sigma_json(capsys):
    doc = account_json(capsys, "--sigma", "1.0", "-q", "0.01", "--steps", "1000", "--delta", "1e-5")
    results = by_method(doc)
    assert doc["query"] == "epsilon" and doc["delta_source"] == "given"
    assert round(results["rdp"]["epsilon"], 3) == 2.101
    assert results["prv"]["lower"] < round(results["prv"]["epsilon"], 3) == 1.828 < results["prv"]["upper"]
    assert round(results["gdp"]["epsilon"], 3) == 1.618 and results["gdp"]["approximate"] is True


def test_sigma_from_epsilon(capsys):
    doc = account_json(capsys, "--eps", "3", "--delta", "1e-5", "--sample-rate", "0.02", "--steps", "1000")
    results = by_method(doc)
    assert doc["query"] == "noise_multiplier" and set(results) == {"rdp", "prv", "pld", "gdp"}
    assert results["rdp"]["noise_multiplier"] == pytest.approx(1.2163, abs=2e-4)
    assert results["gdp"]["noise_multiplier"] < results["prv"]["noise_multiplier"] < results["rdp"]["noise_multiplier"]
    assert all(r["epsilon"] <= 3.0 for r in results.values())


def test_dataset_size_batch_size_epochs_and_default_delta(capsys):
    doc = account_json(capsys, "--sigma", "0.8", "--dataset-size", "42061", "--batch-size", "1024",
                       "--epochs", "10", "--method", "rdp")
    assert doc["steps"] == 411 and doc["sample_rate"] == pytest.approx(1024 / 42061)
    assert doc["delta"] == pytest.approx(1 / (2 * 42061)) and "1/(2n)" in doc["delta_source"]
    code, out, _ = account(capsys, "--sigma", "0.8", "-n", "42061", "--batch-size", "1024", "--epochs", "10",
                           "--method", "rdp")
    assert code == 0 and "1/(2n) with n=42061" in out


def test_schedule_spends_more_than_constant_noise(capsys):
    common = ["--sigma", "1.0", "-q", "0.01", "--steps", "1000", "--delta", "1e-5", "--method", "rdp"]
    constant = by_method(account_json(capsys, *common))["rdp"]["epsilon"]
    decaying = account_json(capsys, *common, "--schedule", "exp:0.1")
    assert decaying["schedule"] == "exp:0.1" and by_method(decaying)["rdp"]["epsilon"] > constant
    sigma = account_json(capsys, "--eps", "3", "-q", "0.01", "--steps", "1000", "--delta", "1e-5",
                         "--method", "gdp", "--schedule", "linear:0.2")
    assert by_method(sigma)["gdp"]["noise_multiplier"] > 0


def test_eps_alone_lists_every_shipped_recipe(capsys, monkeypatch):
    import dptext.data

    sizes = {"e2e": 42061, "sst2": 67349, "dart": 62659, "qnli": 104743, "mnli": 392702, "qqp": 363846}
    monkeypatch.setattr(dptext.data, "train_size", lambda data_cfg: sizes.get(data_cfg.dataset, 10_000))
    doc = account_json(capsys, "--eps", "3")
    shipped = sorted(p.stem for p in (Path(__file__).parents[1] / "recipes").glob("*.yaml"))
    assert doc["query"] == "recipes" and sorted(r["recipe"] for r in doc["results"]) == shipped
    for row in doc["results"]:
        recipe = load_recipe(Path(__file__).parents[1] / "recipes" / f"{row['recipe']}.yaml")
        if not recipe.privacy.enabled:  # the convergence baselines: listed, with the reason they have no σ
            assert row["noise_multiplier"] is None and "non-private" in row["note"]
            continue
        if recipe.privacy.unit == "user":  # q counts users, which only the run reads from the data
            assert row["noise_multiplier"] is None and "privacy.unit=user" in row["note"]
            continue
        assert row["noise_multiplier"] > 0 and row["epsilon"] <= 3.0
        assert row["sample_rate"] == recipe.train.batch_size / row["dataset_size"]


def test_eps_alone_explains_recipes_it_cannot_calibrate(capsys, monkeypatch, tmp_path):
    import dptext.data
    from dptext.errors import UserError

    def size(data_cfg):
        if data_cfg.dataset == "qqp":
            raise UserError("The training size of x is only known from its data; pass data.path=.")
        return 10_000

    monkeypatch.setattr(dptext.data, "train_size", size)
    (tmp_path / "a-unknown.yaml").write_text("data:\n  dataset: qqp\n")
    (tmp_path / "b-public.yaml").write_text("privacy:\n  enabled: false\n")
    (tmp_path / "c-pinned.yaml").write_text("privacy:\n  noise_multiplier: 0.9\n  accountant: gdp\n"
                                            "train:\n  batch_size: 100\n  epochs: 1\n")
    rows = account_json(capsys, "--eps", "3", "--recipes", str(tmp_path))["results"]
    assert rows[0] == {"recipe": "a-unknown", "accountant": "rdp", "noise_multiplier": None,
                       "note": "The training size of x is only known from its data; pass data.path=."}
    assert rows[1]["noise_multiplier"] is None and "non-private" in rows[1]["note"]
    assert rows[2]["steps"] == 100 and rows[2]["delta"] == 5e-5 and rows[2]["noise_multiplier"] > 0
    assert rows[2]["note"] == "GDP approximation; the recipe pins σ=0.9, which overrides this"


def _run_with_ledger(tmp_path: Path, steps: int) -> Path:
    run = RunDir.create(load_recipe(None, ["name=acct"]), out=tmp_path / "run")
    ledger = PrivacyLedger(dataset_size=50_000)
    ledger.record_steps(0.01, 1.0, steps)
    run.save_ledger(ledger.to_dict())
    return run.path


def test_run_directory_reports_its_ledger(capsys, tmp_path):
    run_dir = _run_with_ledger(tmp_path, 1000)
    doc = account_json(capsys, str(run_dir))
    assert doc["query"] == "ledger" and doc["steps"] == 1000 and doc["delta"] == 1e-5
    assert round(by_method(doc)["rdp"]["epsilon"], 3) == 2.101
    code, out, _ = account(capsys, str(run_dir))
    assert code == 0 and "ε spent after 1000 steps" in out
    classical = account_json(capsys, str(run_dir), "--method", "rdp", "--conversion", "classical")
    assert by_method(classical)["rdp"]["epsilon"] > by_method(doc)["rdp"]["epsilon"]
    narrow = by_method(account_json(capsys, str(run_dir), "--method", "prv", "--prv-eps-error", "0.02"))["prv"]
    assert narrow["upper"] - narrow["lower"] == pytest.approx(0.04, abs=1e-3)


def test_a_run_headline_is_an_upper_bound_and_names_what_the_model_carries(capsys, tmp_path):
    run = RunDir.create(load_recipe(None, ["name=prv"]), out=tmp_path / "run")
    ledger = PrivacyLedger(dataset_size=50_000, accountant="prv")
    ledger.record_steps(0.01, 1.0, 1000)
    run.save_ledger(ledger.to_dict())
    prv = by_method(account_json(capsys, str(run.path)))["prv"]
    code, out, err = account(capsys, str(run.path))
    assert code == 0 and f"ε ≤ {prv['upper']:.4g} " in out and prv["upper"] > prv["epsilon"]
    assert "carries" not in out + err  # a plain DP-SGD run: the table is the whole story
    own = {"private": True, "accountant": "prv", "delta": 1e-5,
           "epsilon": {"prv": {"epsilon": prv["epsilon"], "upper": prv["upper"]}, "rdp": {"epsilon": 9.0}}}
    teacher = {"epsilon": 1.5, "delta": 1e-5}
    run.save_result({"privacy": own, "privacy_claim": {"teacher": teacher, "student_epsilon": 1.0}})  # DPKD
    code, out, err = account(capsys, str(run.path))
    assert code == 0 and f"carries ε ≤ {1.5 + prv['upper']:.4g}, δ = 2e-05 in all" in " ".join((out + err).split())


def test_plot_of_epsilon_against_steps(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    run_dir = _run_with_ledger(tmp_path, 500)
    target = tmp_path / "eps.png"
    code, _, err = account(capsys, str(run_dir), "--plot", str(target))
    assert code == 0, err
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = account(capsys, "--sigma", "1", "-q", "0.01", "--steps", "200", "--delta", "1e-5",
                           "--plot", str(tmp_path / "q.png"), "--method", "rdp", "--method", "gdp")
    assert code == 0 and (tmp_path / "q.png").stat().st_size > 1000


@pytest.mark.parametrize("args,message", [
    ([], "Give --sigma to find ε"),
    (["--eps", "3", "--sigma", "1"], "not both"),
    (["--sigma", "1", "-q", "0.01", "--steps", "100"], "No δ given"),
    (["--sigma", "1", "-q", "0.01", "--delta", "1e-5"], "Give --steps"),
    (["--sigma", "1", "-q", "2", "--steps", "100", "--delta", "1e-5"], "sampling rate q must be in (0, 1]"),
    (["--sigma", "-1", "-q", "0.1", "--steps", "100", "--delta", "1e-5"], "noise multiplier σ must be a positive"),
    (["--eps", "0", "-q", "0.1", "--steps", "100", "--delta", "1e-5"], "target ε must be a positive"),
    (["--eps", "3", "-q", "0.1", "--steps", "100", "--delta", "1"], "δ must be in (0, 1)"),
    (["--sigma", "1", "-q", "0.1", "--steps", "0", "--delta", "1e-5"], "steps must be a whole number"),
    (["--sigma", "1", "-n", "10", "--batch-size", "20", "--epochs", "1"], "exceeds the dataset size"),
    (["--sigma", "1", "-q", "0.1", "--steps", "9", "--delta", "1e-5", "--schedule", "cosine"], "Unknown noise"),
    (["--sigma", "1", "-q", "0.1", "--steps", "9", "--delta", "1e-5", "--method", "zcdp"], "Unknown accounting"),
    (["--eps", "3", "--plot", "x.png"], "--plot and --schedule need"),
    (["does-not-exist"], "not a dptext run directory"),
])
def test_bad_input_is_one_sentence_and_exit_code_2(capsys, args, message):
    code, out, err = account(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


def test_run_directory_without_a_ledger(capsys, tmp_path):
    run = RunDir.create(load_recipe(None, ["name=empty"]), out=tmp_path / "run")
    code, _, err = account(capsys, str(run.path))
    assert code == 2 and "no privacy ledger yet" in err


def test_the_command_module_imports_nothing_heavy():
    import subprocess
    import sys

    code = ("import sys, dptext.cli.account; "
            "print([m for m in ('numpy', 'scipy', 'prv_accountant', 'matplotlib') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"
