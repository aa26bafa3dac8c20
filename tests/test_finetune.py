"""`dptext finetune` end to end on tiny models: every task type, the run directory, the ledger, resume."""

from __future__ import annotations

import json

import pytest
import torch

from dptext import config
from dptext.cli.app import main
from dptext.errors import UserError
from dptext.finetune import run_finetune

pytestmark = pytest.mark.integration

TASKS = {
    "table_to_text": ["model.name=tiny-gpt2", "data.dataset=e2e", "data.path={data}/e2e_nlg",
                      "eval.beam_size=2", "eval.max_new_tokens=6"],
    "dialog": ["model.name=tiny-llama", "data.dataset=chitchat", "eval.beam_size=1", "eval.max_new_tokens=6"],
    "language_modeling": ["model.name=tiny-gpt2", "data.dataset=amazon",
                          "data.path={data}/amazon_multidomain_sentiment", "task.control_codes=[category, rating]"],
    "classification": ["model.name=tiny-bert", "data.dataset=sst2", "data.path={data}/sst2", "eval.split=validation"],
    "infilling": ["model.name=tiny-roberta", "data.dataset=sst2", "data.path={data}/sst2", "eval.split=validation",
                  "task.label_words=[-, +]"],
}
COMMON = ["data.max_train_examples=48", "data.max_eval_examples=8", "data.max_length=64", "train.batch_size=12",
          "train.max_steps=3", "train.log_every=1", "privacy.target_epsilon=8", "train.learning_rate=1e-3"]


def recipe_for(task: str, shared_data, *extra: str):
    overrides = [o.format(data=shared_data) for o in TASKS[task]] + COMMON + [f"task.type={task}", f"name={task}"]
    return config.load_recipe(None, overrides + list(extra))


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_task_trains_privately_and_writes_its_run(task, shared_data, tmp_path):
    result = run_finetune(recipe_for(task, shared_data), out=tmp_path / "run")
    run = tmp_path / "run"
    for name in ("resolved.yaml", "provenance.json", "metrics.jsonl", "ledger.json", "result.json",
                 "model/config.json", "checkpoints/LATEST"):
        assert (run / name).exists(), name
    assert result["privacy"]["private"] and result["privacy"]["steps"] == 3
    assert result["metrics"], "the final evaluation produced no metrics"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "epsilon" in r] == [1, 2, 3]
    assert not any("loss" in r or "batch_size" in r for r in steps), "un-noised batch statistics in metrics.jsonl"
    *diagnostics, finished = [json.loads(line) for line in
                              (run / "diagnostics_not_private.jsonl").read_text().splitlines()]
    assert [r["step"] for r in diagnostics] == [1, 2, 3] and all("loss" in r and "batch_size" in r for r in diagnostics)
    assert "final_train_loss" not in result
    # the wall time is a function of the realised batches: in the diagnostics, not in the covered result.json
    saved = json.loads((run / "result.json").read_text())
    assert "seconds" not in saved and finished["event"] == "finished" and finished["total_seconds"] > 0
    assert result["seconds"] == finished["total_seconds"]
    manifest = json.loads((run / "release.json").read_text())
    listed = {f["path"]: f["status"] for f in manifest["files"]}
    on_disk = {p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()}
    assert set(listed) == on_disk, "release.json must list exactly the files of the run"
    assert listed["diagnostics_not_private.jsonl"] == "not_covered" and listed["metrics.jsonl"] == "covered"
    assert all(listed[p] == "not_covered" for p in listed if p.startswith("checkpoints/step-"))
    ledger = json.loads((run / "ledger.json").read_text())
    assert ledger["steps"] == 3 and ledger["runs"][0]["noise_multiplier"] == result["privacy"]["noise_multiplier"]


def test_ledger_epsilon_equals_dptext_account(shared_data, tmp_path, capsys):
    result = run_finetune(recipe_for("classification", shared_data, "train.max_steps=5"), out=tmp_path / "run")
    privacy = result["privacy"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_code:
        main(["account", "--sigma", repr(privacy["noise_multiplier"]), "--sample-rate", repr(privacy["sample_rate"]),
              "--steps", "5", "--delta", repr(privacy["delta"]), "--json"])
    assert exit_code.value.code == 0
    reported = json.loads(capsys.readouterr().out)
    by_method = {row["method"]: row for row in reported["results"]}
    assert by_method["rdp"]["epsilon"] == pytest.approx(privacy["epsilon"]["rdp"]["epsilon"], rel=1e-9)
    assert by_method["gdp"]["epsilon"] == pytest.approx(privacy["epsilon"]["gdp"]["epsilon"], rel=1e-9)
    # σ was calibrated so that 5 steps spend the target ε under the recipe's accountant (RDP)
    assert privacy["epsilon"]["rdp"]["epsilon"] == pytest.approx(8.0, rel=1e-3)


def _final_weights(run_dir):
    state = torch.load(run_dir / "checkpoints" / "step-00000006.pt", weights_only=False)
    return state["model"]


def test_interrupted_run_resumes_to_identical_parameters(shared_data, tmp_path, interrupt_training):
    extra = ("train.max_steps=6", "train.checkpoint_every=2", "privacy.reproducible_noise=true")  # two runs compared
    run_finetune(recipe_for("table_to_text", shared_data, *extra, "eval.max_new_tokens=2"), out=tmp_path / "a")
    resume_normally = interrupt_training(5)
    with pytest.raises(KeyboardInterrupt):
        run_finetune(recipe_for("table_to_text", shared_data, *extra, "eval.max_new_tokens=2"), out=tmp_path / "b")
    resume_normally()
    assert not (tmp_path / "b" / "result.json").exists()
    resumed = run_finetune(resume=tmp_path / "b")
    straight, again = _final_weights(tmp_path / "a"), _final_weights(tmp_path / "b")
    assert straight.keys() == again.keys()
    assert all(torch.equal(straight[k], again[k]) for k in straight)
    assert resumed["privacy"]["steps"] == 6
    ledger = json.loads((tmp_path / "b" / "ledger.json").read_text())
    assert ledger["steps"] == 6
    logged = [json.loads(line) for line in (tmp_path / "b" / "diagnostics_not_private.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "event" not in r] == [1, 2, 3, 4, 5, 6]
    assert [r["event"] for r in logged if "event" in r] == ["finished"]  # the interrupted invocation wrote none


def test_a_resume_after_the_training_data_changed_is_refused(shared_data, tmp_path, interrupt_training, monkeypatch):
    """n, hence q and δ = 1/(2n), come from the data as it is when the run is (re)built: a resume must not continue
    the account under other terms."""
    data = tmp_path / "sst2"
    data.mkdir()
    for name, rows in (("train.tsv", 60), ("dev.tsv", 8), ("test.tsv", 8)):
        lines = (shared_data / "sst2" / name).read_text().splitlines(keepends=True)
        (data / name).write_text("".join(lines[: rows + 1]))
    extra = ("data.max_train_examples=null", f"data.path={data}", "train.max_steps=4", "train.checkpoint_every=2")
    resume_normally = interrupt_training(3)
    with pytest.raises(KeyboardInterrupt):
        run_finetune(recipe_for("classification", shared_data, *extra), out=tmp_path / "run")
    resume_normally()
    lines = (data / "train.tsv").read_text().splitlines(keepends=True)
    (data / "train.tsv").write_text("".join(lines[:51]))  # ten training sentences gone
    with pytest.raises(UserError, match=r"changed since it started \(n 60 -> 50; δ 0.00833 -> 0.01; q 0.2 -> 0.24"):
        run_finetune(resume=tmp_path / "run")
    (data / "train.tsv").write_text("".join(lines))  # the data it started with
    from dptext.finetune import setup

    calibrated = setup.noise_for
    monkeypatch.setattr(setup, "noise_for", lambda recipe, plan: 1.1 * calibrated(recipe, plan))  # σ re-calibrated
    with pytest.raises(UserError, match=r"changed since it started \(σ "):
        run_finetune(resume=tmp_path / "run")
    monkeypatch.setattr(setup, "noise_for", calibrated)
    assert run_finetune(resume=tmp_path / "run")["privacy"]["steps"] == 4  # the run goes on


def test_non_private_baseline_has_no_ledger(shared_data, tmp_path):
    result = run_finetune(recipe_for("classification", shared_data, "privacy.enabled=false"), out=tmp_path / "run")
    assert not result["privacy"]["private"] and not (tmp_path / "run" / "ledger.json").exists()


@pytest.mark.parametrize("adaptation", ["lora", "bias", "top_n", "retrain"])
def test_adaptation_methods_train(adaptation, shared_data, tmp_path):
    result = run_finetune(recipe_for("classification", shared_data, f"model.adaptation={adaptation}",
                                     "model.top_n_layers=1"), out=tmp_path / "run")
    assert 0 < result["trainable_parameters"] <= result["parameters"]
    if adaptation in ("lora", "bias", "top_n"):
        assert result["trainable_parameters"] < result["parameters"]


def test_cli_finetune_json_and_bad_input(shared_data, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(config.dump_recipe(recipe_for("classification", shared_data)))
    with pytest.raises(SystemExit) as code:
        main(["finetune", str(recipe), "train.max_steps=2", "--out", str(tmp_path / "run"), "--json"])
    assert code.value.code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["privacy"]["steps"] == 2 and "accuracy" in result["metrics"]
    with pytest.raises(SystemExit) as code:
        main(["finetune", str(recipe), "privacy.target_epsilon=-1", "--out", str(tmp_path / "bad")])
    assert code.value.code == 2
    assert not (tmp_path / "bad" / "checkpoints").exists()


def test_missing_data_is_a_user_error(tmp_path):
    recipe = config.load_recipe(None, ["model.name=tiny-gpt2", f"data.path={tmp_path / 'nowhere'}"])
    with pytest.raises(UserError):
        run_finetune(recipe, out=tmp_path / "run")
