"""DistilDP end to end on tiny models through the CLI: teacher -> synth -> distill (+ baselines), provenance and ε.

Also: an interrupted synthesis, resumed, writes exactly what a straight-through one writes.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path

import pytest

from dptext.cli.app import main
from dptext.distill import chunked_generation
from dptext.distill import synth as synth_module
from dptext.distill.synth import synthesize
from dptext.errors import UserError

pytestmark = pytest.mark.integration

DATA = Path(os.environ.get("DPTEXT_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
AMAZON = DATA / "amazon_multidomain_sentiment"
SLICE = {"dataset": "amazon", "path": str(AMAZON), "max_train_examples": 48, "max_eval_examples": 8,
         "max_length": 40}
TASK = {"type": "language_modeling", "control_codes": ["category", "rating"],
        "code_domain": {"category": ["books", "dvd", "electronics", "kitchen & housewares"], "rating": [1, 2, 4, 5]}}


def write_recipe(path: Path, **sections) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(sections), encoding="utf-8")
    return path


def cli(args: list[str], capsys) -> dict:
    capsys.readouterr()
    with pytest.raises(SystemExit) as code:
        main(args + ["--json"])
    captured = capsys.readouterr()
    assert code.value.code == 0, captured.err
    return json.loads(captured.out)


def teacher_run(root: Path, name: str, epsilon: float, delta: float | None = None) -> Path:
    recipe = write_recipe(root / f"{name}.yaml", name=name, model={"name": "tiny-llama"}, data=SLICE, task=TASK,
                          privacy={"target_epsilon": epsilon, "delta": delta},
                          train={"batch_size": 12, "max_steps": 2, "learning_rate": 1e-3})
    with pytest.raises(SystemExit) as code:
        main(["finetune", str(recipe), "--out", str(root / name), "--json"])
    assert code.value.code == 0
    return root / name


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    if not AMAZON.is_dir():
        pytest.skip(f"shared datasets not found at {DATA}")
    return teacher_run(tmp_path_factory.mktemp("teacher"), "teacher", 2.0)


def read(folder: Path) -> dict[str, str]:
    return {name: (folder / name).read_text() for name in ("train.jsonl", "validation.jsonl")}


def test_interrupted_synthesis_resumes_to_the_straight_through_output(teacher, tmp_path, monkeypatch):
    settings = dict(n=10, batch_size=3, max_new_tokens=6, validation_fraction=0.3, seed=5)
    # the code histogram's noise is secret (fresh per plan); pinned here so two separate plans can be compared
    monkeypatch.setattr(synth_module, "code_distribution", functools.partial(synth_module.code_distribution, seed=11))
    straight = synthesize(teacher, tmp_path / "straight", **settings)
    assert straight["n"] == 10 and straight["splits"] == {"train": 7, "validation": 3}
    with pytest.raises(UserError, match="other values of --n"):  # a finished folder is compared too (issue 46)
        synthesize(teacher, tmp_path / "straight", **{**settings, "n": 11})
    with pytest.raises(UserError, match="--top-p must be in"):
        synthesize(teacher, tmp_path / "new", **settings, top_p=1.5)
    assert not (tmp_path / "new").exists()

    calls = {"n": 0}
    real = chunked_generation.generate_batch

    def crash_on_third_batch(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # killed mid-run
        return real(*args, **kwargs)

    monkeypatch.setattr(chunked_generation, "generate_batch", crash_on_third_batch)
    with pytest.raises(KeyboardInterrupt):
        synthesize(teacher, tmp_path / "resumed", **settings)
    assert (chunked_generation.completed_chunks(tmp_path / "resumed") == 2
            and not (tmp_path / "resumed/train.jsonl").exists())
    monkeypatch.setattr(chunked_generation, "generate_batch", real)
    synthesize(teacher, tmp_path / "resumed", **settings)
    assert read(tmp_path / "resumed") == read(tmp_path / "straight")
    records = [json.loads(line) for text in read(tmp_path / "straight").values() for line in text.splitlines()]
    assert sorted(r["index"] for r in records) == list(range(10))  # none lost, none twice
    finished = {p: p.read_bytes() for p in (tmp_path / "straight").rglob("*") if p.is_file()}
    with pytest.raises(UserError, match="other values of --n"):  # a finished folder is not "complete" for another n
        synthesize(teacher, tmp_path / "straight", **{**settings, "n": 12})
    assert {p: p.read_bytes() for p in (tmp_path / "straight").rglob("*") if p.is_file()} == finished
    assert all(r["code"] == f"Category: {r['category']} || Rating: {r['rating']}" for r in records)
    partial = synthesize(teacher, tmp_path / "other", **settings, max_chunks=1)
    assert partial["complete"] is False and partial["records_on_disk"] == 3
    with pytest.raises(UserError):  # other settings cannot continue this folder
        synthesize(teacher, tmp_path / "other", **{**settings, "max_new_tokens": 7})
    # nor another teacher (the records on disk and the code histogram are the first one's: provenance would name the
    # second) or other code settings (the release flags would follow them), refused before anything is rewritten
    on_disk = {p: p.read_bytes() for p in (tmp_path / "other").rglob("*") if p.is_file()}
    shutil.copytree(teacher, tmp_path / "twin")
    with pytest.raises(UserError, match="other values of teacher run"):
        synthesize(tmp_path / "twin", tmp_path / "other", **settings)
    with pytest.raises(UserError, match="other values of teacher run"):  # a finished folder: not "complete" either
        synthesize(tmp_path / "twin", tmp_path / "straight", **settings)
    with pytest.raises(UserError, match="other values of code histogram"):
        synthesize(teacher, tmp_path / "other", **settings, code_mechanism="exact")
    assert {p: p.read_bytes() for p in (tmp_path / "other").rglob("*") if p.is_file()} == on_disk
    assert {p: p.read_bytes() for p in (tmp_path / "straight").rglob("*") if p.is_file()} == finished


def test_teacher_synth_distill_carry_the_privacy_claim(teacher, tmp_path, capsys):
    teacher_result = json.loads((teacher / "result.json").read_text())
    eps_teacher = teacher_result["privacy"]["epsilon"]["rdp"]["epsilon"]
    delta_teacher = teacher_result["privacy"]["delta"]
    synthetic = tmp_path / "synthetic"
    first = cli(["synth", str(teacher), "--out", str(synthetic), "--n", "16", "--batch-size", "8",
                 "--max-new-tokens", "8", "--validation-fraction", "0.25", "--codes", "gaussian",
                 "--code-epsilon", "0.5", "--code-delta", "1e-6", "--max-chunks", "1"], capsys)
    assert first["complete"] is False and first["records_on_disk"] == 8
    summary = cli(["synth", str(teacher), "--out", str(synthetic), "--n", "16", "--batch-size", "8",
                   "--max-new-tokens", "8", "--validation-fraction", "0.25", "--codes", "gaussian",
                   "--code-epsilon", "0.5", "--code-delta", "1e-6", "--check-training-copies"], capsys)
    assert summary["splits"] == {"train": 12, "validation": 4}
    assert 0 <= summary["exact_duplicate_rate"] < 1 and "training_text_copies" not in summary
    copies = json.loads((synthetic / "training_copies_not_private.json").read_text())
    assert copies["count"] >= 0 and "NOT covered" in copies["note"]
    release = {f["path"]: f["status"] for f in json.loads((synthetic / "release.json").read_text())["files"]}
    assert release["train.jsonl"] == "covered" and release["training_copies_not_private.json"] == "not_covered"
    assert set(release) == {p.relative_to(synthetic).as_posix() for p in synthetic.rglob("*") if p.is_file()}
    provenance = json.loads((synthetic / "provenance.json").read_text())
    assert provenance["teacher"]["teacher_run"] == str(teacher.resolve())
    assert provenance["teacher"]["epsilon"] == eps_teacher and provenance["teacher"]["accountant"] == "rdp"
    assert provenance["code_distribution"]["mechanism"] == "gaussian"
    assert provenance["privacy"]["epsilon"] == pytest.approx(eps_teacher + 0.5)
    assert provenance["privacy"]["delta"] == pytest.approx(delta_teacher + 1e-6)
    ledger = json.loads((synthetic / "ledger.json").read_text())
    assert [m["epsilon"] for m in ledger["mechanisms"]] == [eps_teacher, 0.5] and release["ledger.json"] == "covered"
    assert ledger["total"]["epsilon"] == pytest.approx(eps_teacher + 0.5)

    recipe = write_recipe(tmp_path / "distill.yaml", name="student", data=SLICE, task=TASK,
                          privacy={"target_epsilon": 2.5}, train={"batch_size": 4, "max_steps": 3},
                          distill={"teacher": str(teacher), "synthetic": str(synthetic), "student_layers": [1]})
    result = cli(["distill", str(recipe), "--out", str(tmp_path / "student")], capsys)
    run = tmp_path / "student"
    for name in ("resolved.yaml", "result.json", "student.json", "student_init/config.json", "model/config.json",
                 "checkpoints/LATEST", "metrics.jsonl"):
        assert (run / name).exists(), name
    stored = json.loads((run / "result.json").read_text())
    assert stored["method"] == "distildp" and stored["kd_lambda"] == 0.4
    assert stored["privacy"]["epsilon"] == pytest.approx(eps_teacher + 0.5) and stored["privacy"]["inherited"]
    assert stored["privacy"]["teacher"]["teacher_run"] == str(teacher.resolve())
    assert stored["privacy"]["code_distribution"]["epsilon"] == 0.5
    assert stored["student"]["layers"] == [1] and stored["student"]["source"] == "tiny-llama"
    assert stored["eval_split"] == "test" and 1 < result["metrics"]["perplexity"] < 1e4
    assert "distill" in (run / "resolved.yaml").read_text()

    zero = cli(["distill", str(recipe), "distill.method=zero_shot", "--out", str(tmp_path / "zero")], capsys)
    assert zero["privacy_claim"]["epsilon"] == 0 and zero["metrics"]["perplexity"] > 1


def test_dpkd_splits_the_budget_and_synthetic_only_is_lambda_zero(teacher, tmp_path, capsys):
    half = teacher_run(tmp_path, "half", 1.0, delta=0.005)
    recipe = write_recipe(tmp_path / "dpkd.yaml", name="dpkd", data=SLICE, task=TASK,
                          privacy={"target_epsilon": 2.0, "delta": 0.01},
                          train={"batch_size": 12, "max_steps": 2},
                          distill={"method": "dpkd", "teacher": str(half), "student_layers": [0]})
    result = cli(["distill", str(recipe), "--out", str(tmp_path / "dpkd")], capsys)
    claim, privacy = result["privacy_claim"], result["privacy"]
    teacher_eps = json.loads((half / "result.json").read_text())["privacy"]["epsilon"]["rdp"]["epsilon"]
    assert (claim["student_epsilon"] == pytest.approx(2.0 - teacher_eps)
            and claim["student_delta"] == pytest.approx(0.005))
    assert privacy["delta"] == pytest.approx(0.005) and privacy["target_epsilon"] == pytest.approx(2.0 - teacher_eps)
    assert privacy["epsilon"]["rdp"]["epsilon"] == pytest.approx(2.0 - teacher_eps, rel=1e-3)
    assert claim["epsilon"] == 2.0 and claim["delta"] == 0.01
    # reused as a teacher, the DPKD student hands on what its model carries: its teacher's share and its own
    carried = teacher_eps + privacy["epsilon"]["rdp"]["epsilon"]
    synthesize(tmp_path / "dpkd", tmp_path / "from-dpkd", n=4, batch_size=4, max_new_tokens=4, validation_fraction=0)
    provenance = json.loads((tmp_path / "from-dpkd" / "provenance.json").read_text())
    assert provenance["teacher"]["epsilon"] == pytest.approx(carried) and carried > 1.9
    assert provenance["teacher"]["delta"] == pytest.approx(0.01)

    with pytest.raises(SystemExit) as code:  # the synthetic-data methods need synthetic data
        main(["distill", str(recipe), "distill.method=synthetic_only", "--out", str(tmp_path / "x")])
    assert code.value.code == 2


def test_exact_codes_only_on_request_and_then_marked_not_covered(teacher, tmp_path):
    synthesize(teacher, tmp_path / "exact", n=4, batch_size=4, max_new_tokens=4, validation_fraction=0.25,
               code_mechanism="exact")
    release = json.loads((tmp_path / "exact" / "release.json").read_text())
    status = {f["path"]: f["status"] for f in release["files"]}
    assert "exact_codes" in release["flags"]
    assert all(status[name] == "not_covered" for name in ("train.jsonl", "plan.json", "summary.json"))
    plan = json.loads((tmp_path / "exact" / "plan.json").read_text())["distribution"]
    assert "noisy_counts" not in plan and "exact_private_frequencies" in plan
    assert json.loads((tmp_path / "exact" / "provenance.json").read_text())["privacy"]["note"].startswith("NOT COVERED")


def test_the_results_collector_reads_every_row_of_a_real_chain(teacher, tmp_path, capsys):
    """benchmarks/collect_distill.py (README's DistilDP table) on the files the CLI really writes, laid out as the
    results queue's chain: each row's ε is the one its run carries, DP-SGD rows also get their own PLD ε."""
    import importlib.util
    import sys

    benchmarks = Path(__file__).resolve().parent.parent / "benchmarks"
    modules = {}
    for name in ("collect_distill", "results_tables"):
        spec = importlib.util.spec_from_file_location(name, benchmarks / f"{name}.py")
        modules[name] = importlib.util.module_from_spec(spec)
        sys.modules[name] = modules[name]
        spec.loader.exec_module(modules[name])
    collect_distill, tables = modules["collect_distill"], modules["results_tables"]

    chain = tmp_path / "chain"
    chain.mkdir()
    (chain / "teacher-eps2").symlink_to(teacher)
    cli(["synth", str(teacher), "--out", str(chain / "synthetic"), "--n", "16", "--batch-size", "8",
         "--max-new-tokens", "6", "--validation-fraction", "0.25", "--code-epsilon", "0.1"], capsys)
    common = dict(data=SLICE, task=TASK, privacy={"target_epsilon": 2.0}, train={"batch_size": 8, "max_steps": 2})
    distill = {"teacher": str(teacher), "synthetic": str(chain / "synthetic"), "student_layers": [1]}
    recipe = write_recipe(tmp_path / "distill.yaml", name="student", distill=distill, **common)
    for method in ("distildp", "zero_shot", "dp_sgd"):
        cli(["distill", str(recipe), f"distill.method={method}", "--out", str(chain / method)], capsys)
    rows = collect_distill.collect(chain)

    assert set(rows) == {"teacher_eps2", "synthetic", "distildp", "zero_shot", "dp_sgd"}
    teacher_result = json.loads((teacher / "result.json").read_text())
    eps_teacher = teacher_result["privacy"]["epsilon"]["rdp"]["epsilon"]
    assert rows["teacher_eps2"]["epsilon"] == eps_teacher and rows["teacher_eps2"]["steps"] == 2
    assert rows["distildp"]["epsilon"] == pytest.approx(eps_teacher + 0.1)
    assert rows["synthetic"]["privacy"]["epsilon"] == pytest.approx(eps_teacher + 0.1) and rows["synthetic"]["n"] == 16
    assert rows["dp_sgd"]["epsilon"] == 2.0 and rows["zero_shot"]["epsilon"] == 0
    for key in ("teacher_eps2", "dp_sgd"):  # their own DP-SGD steps: PLD is tighter than the RDP bound they ran to
        assert 0 < rows[key]["epsilon_pld_own_steps"] < rows[key]["epsilon"]
    assert rows["distildp"]["epsilon_pld_own_steps"] is None  # its training is post-processing, no ledger of steps
    for key in ("teacher_eps2", "distildp", "zero_shot", "dp_sgd"):
        stored = json.loads((chain / collect_distill.FOLDERS[key] / "result.json").read_text())
        assert rows[key]["test_perplexity"] == stored["metrics"]["perplexity"] > 1
        assert rows[key]["wall_seconds"] > 0 and int(rows[key]["commit"][:40], 16) >= 0  # the git revision
    assert rows["distildp"]["model"].startswith("tiny-llama 1/")
    table = "\n".join(tables.distill(rows))
    assert f"| {tables.DISTILL_ROWS['dpkd']} | running |" in table
    assert f"| {rows['distildp']['test_perplexity']:.4g} |" in table and "| 2.1 |" in table  # ε: the teacher's 2 + 0.1
