"""`dptext finetune` and its run directory (issue 21 points 2–4, 6): secret noise by default and bit-exact resume
from generator states, reproducible noise only on request and then labelled, the ledger never behind a
checkpoint, shuffling refused for private runs, and only guaranteed accountants calibrating a run."""

from __future__ import annotations

import json
from pathlib import Path
import shutil

import pytest
import torch

from dptext import atomic, config, runs
from dptext.cli.app import main
from dptext.errors import UserError
from dptext.finetune import run_finetune

pytestmark = pytest.mark.integration

STEPS = 4


def recipe(shared_data, *extra: str):
    return config.load_recipe(None, [
        "name=tiny", "model.name=tiny-bert", "data.dataset=sst2", f"data.path={shared_data}/sst2",
        "task.type=classification", "eval.split=validation", "data.max_train_examples=24",
        "data.max_eval_examples=4", "data.max_length=32", "train.batch_size=6", f"train.max_steps={STEPS}",
        "train.log_every=1", "train.checkpoint_every=2", "privacy.target_epsilon=8", "train.learning_rate=1e-2",
        *extra])


def weights(run_dir, step=STEPS):
    return torch.load(run_dir / "checkpoints" / f"step-{step:08d}.pt", weights_only=False)["model"]


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def rewind(run_dir, to_step: int):
    """The run as if it had stopped right after its checkpoint at ``to_step``."""
    (run_dir / "result.json").unlink()
    for later in range(to_step + 1, STEPS + 1):
        (run_dir / "checkpoints" / f"step-{later:08d}.pt").unlink(missing_ok=True)
    (run_dir / "checkpoints" / "LATEST").write_text(f"step-{to_step:08d}.pt\n")


def test_noise_is_secret_by_default_and_resume_is_bit_exact(shared_data, tmp_path, capsys):
    pinned = ("privacy.target_epsilon=null", "privacy.noise_multiplier=1.0")  # the same σ for runs of any length
    first = run_finetune(recipe(shared_data, *pinned), out=tmp_path / "a")
    run_finetune(recipe(shared_data, *pinned, "train.max_steps=2"), out=tmp_path / "b")
    assert not same(weights(tmp_path / "a", 2), weights(tmp_path / "b", 2))  # same train.seed, fresh secret noise
    mechanism = first["privacy"]["mechanism"]
    assert mechanism["noise_secret"] and mechanism["sampling"] == "poisson"
    ledger = json.loads((tmp_path / "a" / "ledger.json").read_text())
    assert ledger["mechanism"]["noise_secret"] and "os.urandom" in ledger["mechanism"]["randomness"]
    assert "pld" in ledger["epsilon"] and ledger["epsilon"]["pld"]["epsilon"] <= ledger["epsilon"]["rdp"]["epsilon"]
    # no checkpointed seed: the resume continues from the generator states, to the same weights
    shutil.copytree(tmp_path / "a", tmp_path / "c")
    rewind(tmp_path / "c", 2)  # checkpoints at 2 and 4 (two are kept)
    run_finetune(resume=tmp_path / "c")
    assert same(weights(tmp_path / "a"), weights(tmp_path / "c"))
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["account", str(tmp_path / "a"), "--method", "rdp"])
    assert "only while" not in "".join(capsys.readouterr())


def test_reproducible_noise_repeats_and_every_artifact_says_the_seed_must_stay_secret(shared_data, tmp_path, capsys):
    extra = ("privacy.reproducible_noise=true", "train.seed=3", "train.max_steps=2")
    result = run_finetune(recipe(shared_data, *extra), out=tmp_path / "a")
    run_finetune(recipe(shared_data, *extra), out=tmp_path / "b")
    assert same(weights(tmp_path / "a", 2), weights(tmp_path / "b", 2))
    assert not result["privacy"]["mechanism"]["noise_secret"]
    assert "only while" in result["privacy"]["mechanism"]["randomness"]
    ledger = json.loads((tmp_path / "a" / "ledger.json").read_text())
    assert "only while that seed stays secret" in ledger["mechanism"]["randomness"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as code:
        main(["account", str(tmp_path / "a"), "--method", "rdp"])
    assert code.value.code == 0 and "only while that seed stays secret" in "".join(capsys.readouterr())
    from dptext.cli.finetune import render_result
    from dptext.output import Output

    render_result(Output(quiet=False), result)
    assert "only while train.seed stays secret" in "".join(capsys.readouterr())
    with pytest.raises(UserError, match="secure_rng"):
        run_finetune(recipe(shared_data, *extra, "privacy.secure_rng=true"), out=tmp_path / "c")


def test_private_shuffle_and_gdp_calibration_are_refused_non_private_shuffle_runs(shared_data, tmp_path):
    with pytest.raises(UserError, match="poisson"):
        run_finetune(recipe(shared_data, "privacy.sampling=shuffle"), out=tmp_path / "a")
    with pytest.raises(UserError, match="approximation"):
        run_finetune(recipe(shared_data, "privacy.accountant=gdp"), out=tmp_path / "b")
    baseline = run_finetune(recipe(shared_data, "privacy.sampling=shuffle", "privacy.enabled=false"),
                            out=tmp_path / "c")
    assert not baseline["privacy"]["private"]


def test_pld_accountant_calibrates_and_heads_the_summary(shared_data, tmp_path):
    from dptext.accounting.carried import guaranteed_epsilon as headline_epsilon

    result = run_finetune(recipe(shared_data, "privacy.accountant=pld", "train.max_steps=2"), out=tmp_path / "a")
    privacy = result["privacy"]
    assert privacy["epsilon"]["pld"]["epsilon"] == pytest.approx(8.0, rel=2e-3)
    assert privacy["epsilon"]["pld"]["epsilon"] <= 8.0
    assert headline_epsilon(privacy) == ("pld", privacy["epsilon"]["pld"]["epsilon"])
    prv = {**privacy, "accountant": "prv"}  # the headline quotes PRV's upper bound, not its estimate
    assert headline_epsilon(prv) == ("prv", privacy["epsilon"]["prv"]["upper"])


class Interrupted(Exception):
    pass


def interrupt_at(monkeypatch, k: int | None):
    """Make the k-th atomic write of the run raise (None: count them); returns the counter."""
    real, count = runs.atomic_write, {"n": 0, "paths": []}

    def write(path, *args, **kwargs):
        count["n"] += 1
        count["paths"].append(Path(path).name)
        if count["n"] == k:
            raise Interrupted(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(runs, "atomic_write", write)  # the checkpoint file
    monkeypatch.setattr(atomic, "atomic_write", write)  # every other file (through atomic_write_text/json)
    return count


def check_ledger_covers_every_checkpoint(run_dir):
    """The invariant `dptext account RUN_DIR` relies on: ledger.steps ≥ every checkpoint on disk."""
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*.pt"))
    if not checkpoints:
        return
    ledger = json.loads((run_dir / "ledger.json").read_text())
    latest = (run_dir / "checkpoints" / "LATEST")
    steps_on_disk = [int(p.stem.split("-")[1]) for p in checkpoints]
    if latest.exists():
        steps_on_disk.append(int(latest.read_text().strip().split("-")[1].split(".")[0]))
    assert ledger["steps"] >= max(steps_on_disk), (ledger["steps"], steps_on_disk)


@pytest.mark.slow
def test_an_interruption_at_every_write_leaves_the_ledger_ahead_and_resume_recovers(shared_data, tmp_path,
                                                                                   monkeypatch):
    every = "train.checkpoint_every=1"
    count = interrupt_at(monkeypatch, None)
    run_finetune(recipe(shared_data, every), out=tmp_path / "count")
    writes = count["n"]
    assert writes >= 3 * STEPS  # ledger, checkpoint and LATEST per step at least
    for k in range(1, writes + 1):
        run_dir = tmp_path / f"k{k}"
        interrupt_at(monkeypatch, k)
        with pytest.raises(Interrupted):
            run_finetune(recipe(shared_data, every), out=run_dir)
        check_ledger_covers_every_checkpoint(run_dir)
        monkeypatch.undo()
        if not (run_dir / "resolved.yaml").exists():
            continue  # interrupted before the run directory existed: nothing to resume
        result = run_finetune(resume=run_dir)
        ledger = json.loads((run_dir / "ledger.json").read_text())
        assert ledger["steps"] == STEPS == result["privacy"]["steps"], k
        check_ledger_covers_every_checkpoint(run_dir)


def test_interrupted_between_ledger_and_checkpoint_pointer(shared_data, tmp_path, monkeypatch):
    """The write that used to lose the race: the ledger of step 2 is on disk, its checkpoint pointer is not."""
    count = interrupt_at(monkeypatch, None)
    run_finetune(recipe(shared_data, "train.max_steps=2", "train.checkpoint_every=1"), out=tmp_path / "count")
    # per step: ledger, checkpoint, LATEST (plus release.json rewrites); interrupt the 2nd step's LATEST
    latest_writes = [i + 1 for i, name in enumerate(count["paths"]) if name == "LATEST"]
    assert len(latest_writes) >= 2
    interrupt_at(monkeypatch, latest_writes[1])
    with pytest.raises(Interrupted, match="LATEST"):
        run_finetune(recipe(shared_data, "train.max_steps=2", "train.checkpoint_every=1"), out=tmp_path / "run")
    monkeypatch.undo()
    ledger = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert ledger["steps"] == 2
    assert (tmp_path / "run" / "checkpoints" / "LATEST").read_text().startswith("step-00000001")
    check_ledger_covers_every_checkpoint(tmp_path / "run")
    result = run_finetune(resume=tmp_path / "run")
    assert result["privacy"]["steps"] == 2
    assert json.loads((tmp_path / "run" / "ledger.json").read_text())["steps"] == 2
