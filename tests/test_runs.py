"""Run directories: contents, atomic writes, interrupted checkpoints, exact resumption."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dptext import config, runs
from dptext.finetune.seeds import capture_rng_state, restore_rng_state
from dptext.errors import UserError


def make_run(tmp_path, name="demo"):
    recipe = config.load_recipe(None, [f"name={name}"])
    return runs.RunDir.create(recipe, root=tmp_path)


def test_create_writes_resolved_recipe_and_provenance(tmp_path):
    run = make_run(tmp_path)
    assert run.path.parent == tmp_path and run.path.name.startswith("demo-")
    assert run.recipe() == config.load_recipe(None, ["name=demo"])
    prov = json.loads((run.path / runs.PROVENANCE).read_text())
    assert prov["git_revision"] and "torch" in prov["packages"] and "dptext" in prov["packages"]
    # the machine a result came from: CPU count and GPU (None without one), since the first GPU runs
    assert prov["cpu_count"] == os.cpu_count() and prov["accelerator"] is None


def test_provenance_names_the_gpu_a_run_computes_on(monkeypatch):
    from dptext import provenance
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert provenance.accelerator() == "NVIDIA H100 80GB HBM3, CUDA 13.0"


def test_two_runs_in_the_same_second_get_distinct_directories(tmp_path):
    assert make_run(tmp_path).path != make_run(tmp_path).path


def test_refuses_to_overwrite_a_started_run(tmp_path):
    run = make_run(tmp_path)
    run.log_metrics({"step": 1, "loss": 1.0})
    with pytest.raises(UserError, match="--resume"):
        runs.RunDir.create(config.Recipe(), out=run.path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a run")
    with pytest.raises(UserError, match="--resume"):
        runs.RunDir.create(config.Recipe(), out=tmp_path / "mine")


def test_a_run_that_never_started_is_taken_over_or_removed(tmp_path):
    run = make_run(tmp_path)  # e.g. killed while loading: only resolved.yaml and provenance.json
    assert run.reusable()
    again = runs.RunDir.create(config.load_recipe(None, ["name=other"]), out=run.path)
    assert again.recipe().name == "other"
    again.remove_unstarted()
    assert not run.path.exists()


def test_open_rejects_a_folder_that_is_not_a_run(tmp_path):
    with pytest.raises(UserError, match="not a dptext run directory"):
        runs.RunDir.open(tmp_path)


def test_metrics_append_and_truncate_on_resume(tmp_path):
    run = make_run(tmp_path)
    for step in range(1, 6):
        run.log_metrics({"step": step, "loss": 1.0 / step})
    with open(run.path / runs.METRICS, "a") as handle:
        handle.write('{"step": 6, "lo')  # a line torn by a crash
    assert [r["step"] for r in run.read_metrics()] == [1, 2, 3, 4, 5]
    run.truncate_metrics_after(3)
    assert [r["step"] for r in run.read_metrics()] == [1, 2, 3]


def test_failed_atomic_write_keeps_the_old_file(tmp_path):
    target = tmp_path / "ledger.json"
    runs.atomic_write_json(target, {"epsilon": 1.0})

    def crash(handle):
        handle.write('{"epsilon": 2')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runs.atomic_write(target, crash)
    assert json.loads(target.read_text()) == {"epsilon": 1.0}
    assert [p.name for p in tmp_path.iterdir()] == ["ledger.json"]


def test_interrupted_checkpoint_leaves_the_previous_one_loadable(tmp_path, monkeypatch):
    run = make_run(tmp_path)
    run.save_checkpoint({"weights": torch.ones(3)}, step=10)
    real_save = torch.save

    def save_then_die(obj, handle):
        real_save(obj, handle)
        handle.truncate(20)  # half a file on disk, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run.save_checkpoint({"weights": torch.zeros(3)}, step=20)
    monkeypatch.setattr(torch, "save", real_save)
    state = run.load_checkpoint()
    assert state["step"] == 10 and torch.equal(state["weights"], torch.ones(3))
    assert sorted(p.name for p in run.checkpoint_dir.iterdir()) == [runs.LATEST, "step-00000010.pt",
                                                                        "step-00000010.pt.sha256"]


def test_old_checkpoints_are_pruned_after_the_new_one_is_complete(tmp_path):
    run = make_run(tmp_path)
    for step in (1, 2, 3, 4):
        run.save_checkpoint({"x": step}, step=step, keep=2)
    assert sorted(p.name for p in run.checkpoint_dir.glob("*.pt")) == ["step-00000003.pt", "step-00000004.pt"]
    assert run.load_checkpoint()["x"] == 4


def _train(run: runs.RunDir, total_steps: int, crash_at: int | None = None) -> torch.Tensor:
    """A minimal noisy training loop that checkpoints every 3 steps and resumes from the run directory."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    start = 0
    state = run.load_checkpoint()
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        restore_rng_state(state["rng"])
        start = state["step"]
        run.truncate_metrics_after(start)
    for step in range(start + 1, total_steps + 1):
        if step == crash_at:
            raise KeyboardInterrupt
        x = torch.randn(8, 4)  # data and noise both come from the RNG that must be restored
        loss = (model(x).squeeze() - x.sum(1)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():
            p.grad += 0.1 * torch.randn_like(p)
        optimizer.step()
        run.log_metrics({"step": step, "loss": loss.item()})
        if step % 3 == 0:
            run.save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                 "rng": capture_rng_state()}, step=step)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_interrupted_run_resumes_to_the_same_parameters(tmp_path):
    straight = _train(make_run(tmp_path / "a"), total_steps=10)
    run = make_run(tmp_path / "b")
    with pytest.raises(KeyboardInterrupt):
        _train(run, total_steps=10, crash_at=8)
    resumed = _train(runs.RunDir.open(run.path), total_steps=10)
    assert torch.equal(straight, resumed)
    assert [r["step"] for r in run.read_metrics()] == list(range(1, 11))


def test_a_run_directory_that_cannot_be_written_is_one_sentence_and_leaves_nothing(tmp_path, monkeypatch):
    """An --out the pre-checks pass but the disk refuses (root ignores permissions; a full or read-only disk):
    one sentence, and the folders this call created are gone (issue 43: it was an 'unexpected' exit 1)."""
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runs, "atomic_write_json", disk_full)
    out = tmp_path / "new" / "deeper" / "run"
    with pytest.raises(UserError, match="^The run directory '.*run' cannot be written \\(No space left on device\\); "
                                        "choose another --out.$"):
        runs.RunDir.create(config.Recipe(), out=out)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where mkdir fails even for root")
def test_finetune_out_under_proc_is_one_sentence_exit_2():
    import subprocess
    import sys

    recipe = os.path.join(os.path.dirname(__file__), "..", "recipes", "sst2-head.yaml")
    proc = subprocess.run([sys.executable, "-m", "dptext", "finetune", recipe, "model.name=tiny-bert",
                           "data.max_train_examples=8", "--out", f"/proc/dptext-run-{os.getpid()}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "cannot be written" in proc.stderr and "choose another --out" in proc.stderr
    assert "unexpected" not in proc.stderr and "Traceback" not in proc.stderr
