"""Issue 46: runs that survive concurrency and faults: one writer per run folder, checkpoints that verify, a
damaged ledger, a full disk. Each case ends in a correct result or one sentence and exit 2, nothing half-written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dptext import config, locking, runs
from dptext.errors import UserError
from test_bad_input_cases import cli, finetune, refused

ROOT = Path(__file__).resolve().parents[1]
HOLD = ("import sys, time; from dptext.locking import lock_folder; lock_folder(sys.argv[1]); "
        "print('locked', flush=True); time.sleep(60)")


def env():
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture
def holder():
    """Another process holding a folder's lock (the way a running `dptext finetune` holds its run folder)."""
    started = []

    def hold(folder: Path) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, env=env(),
                                   text=True)
        assert process.stdout.readline().strip() == "locked"
        started.append(process)
        return process

    yield hold
    for process in started:
        process.kill()
        process.wait()


def make_run(tmp_path, name="demo"):
    run = runs.RunDir.create(config.load_recipe(None, [f"name={name}"]), root=tmp_path)
    locking.release_all()  # as when the command that made it ended
    return run


# --------------------------------------------------------------------------- one writer per run folder

def test_a_second_finetune_into_a_locked_folder_is_refused_and_writes_nothing(tmp_path, capsys, holder):
    out = tmp_path / "run"
    process = holder(out)
    line = refused(finetune(tmp_path), capsys, "being written by another dptext process", f"pid {process.pid}")
    assert str(out) in line and list(out.iterdir()) == []
    run = make_run(tmp_path)  # a run under way: its writer is named, not only "already exists and is not empty"
    run.log_metrics({"step": 1, "epsilon": 0.1})
    holder(run.path)
    refused(finetune(tmp_path, out=run.path.name), capsys, "being written by another dptext process")


def test_a_resume_of_a_run_another_process_writes_is_refused(tmp_path, capsys, holder):
    run = make_run(tmp_path)
    before = sorted(p.name for p in run.path.iterdir())
    process = holder(run.path)
    refused(["finetune", "--resume", str(run.path)], capsys, "being written", f"pid {process.pid}")
    assert sorted(p.name for p in run.path.iterdir()) == before
    with pytest.raises(UserError, match="being written"):  # a library caller too, not only the CLI
        runs.RunDir.open(run.path).lock()


def test_the_lock_holder_removes_the_temporary_files_and_staging_folders_a_killed_writer_left(tmp_path):
    """A SIGKILL inside ``atomic_write`` leaves ``.NAME.XXXX.tmp`` (CI, session 27: a checkpoint's, after the
    resume finished), inside ``atomic_directory`` a staging folder; the next holder of the lock removes them, and
    nothing else (FSDP2's staging folders are sharded_checkpoint's to clean)."""
    run = make_run(tmp_path)
    checkpoints = run.checkpoint_dir
    checkpoints.mkdir(exist_ok=True)
    dead = [checkpoints / ".step-00000003.pt.tzcho6g0.tmp", run.path / ".ledger.json.k2j3.tmp"]
    kept = [checkpoints / ".step-00000004.dcp.tmp", run.path / ".cache", checkpoints / "step-00000002.pt"]
    for path in dead + kept[2:]:
        path.write_bytes(b"partial")
    staging = run.path / ".model-k2_9xq0a"  # atomic_directory's staging of a model save cut short: a whole copy
    for folder in (staging, *kept[:2]):
        folder.mkdir()
    (staging / "model.safetensors").write_bytes(b"weights")
    runs.RunDir.open(run.path).lock()
    assert [path.exists() for path in dead + [staging] + kept] == [False, False, False, True, True, True]
    locking.release_all()


def test_synth_and_mia_refuse_a_folder_another_process_writes(tmp_path, capsys, holder):
    """The other writers of run and synth folders: `dptext synth --out` and `dptext mia RUN_DIR` (which writes its
    report into the run) are refused before they load a model, naming the holder."""
    process = holder(tmp_path / "synthetic")
    refused(["synth", str(tmp_path / "teacher"), "--out", str(tmp_path / "synthetic"), "--n", "4"], capsys,
            "synthetic-data folder", f"pid {process.pid}")
    assert list((tmp_path / "synthetic").iterdir()) == []
    run = make_run(tmp_path)
    run.save_result({"metrics": {}})  # as if finished (mia refuses an unfinished run first)
    (run.path / "model").mkdir()
    process = holder(run.path)
    refused(["mia", str(run.path)], capsys, "being written by another dptext process", f"pid {process.pid}")


def test_the_lock_dies_with_its_process_and_is_reentrant_within_one(tmp_path, holder):
    folder = tmp_path / "run"
    process = holder(folder)
    with pytest.raises(UserError, match=f"pid {process.pid}"):
        locking.lock_folder(folder)
    process.kill()  # a crash: the kernel drops the lock, no stale lock is left to clear by hand
    process.wait()
    locking.lock_folder(folder)
    locking.lock_folder(folder)  # this process's own second entry point (RunDir.create, then resume code)
    assert locking.holds_lock(folder)
    locking.release_all()
    assert not locking.holds_lock(folder)


@pytest.mark.slow  # two torchrun launches of 2 processes: about a minute on 2 cores
def test_under_torchrun_rank_0_alone_locks_and_a_second_launch_writes_nothing(tmp_path, holder):
    """Rank 0 alone takes the run folder's lock (dptext/finetune/run.py), and that suffices: the other ranks write
    into the folder only FSDP2's checkpoint shards, and only inside collectives that rank 0 joins after it holds the
    lock (a new run's folder name is broadcast by rank 0 once it holds it; a resumed run's ranks meet first in
    init_process_group, which rank 0 reaches only after run.lock()). So a launch whose rank 0 is refused writes
    nothing from any rank. Here: 2 gloo processes into a folder another process holds, as a running launch's rank 0
    does, new and resumed: refused in one sentence naming the holder, nothing written, no rank left waiting."""
    from two_ranks import run_process_group

    def torchrun(*args: str) -> str:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   "-m", "dptext", *args]
        done = run_process_group(command, 300, cwd=tmp_path, env={**env(), "OMP_NUM_THREADS": "1"})
        assert done.returncode != 0, done.stdout + done.stderr
        return done.stdout + done.stderr

    out = tmp_path / "run"
    process = holder(out)
    text = torchrun(*finetune(tmp_path)[:-2], "--out", str(out))
    assert f"being written by another dptext process (pid {process.pid})" in text, text[-3000:]
    assert list(out.iterdir()) == []
    run = make_run(tmp_path)
    run.log_metrics({"step": 1, "epsilon": 0.1})
    before = {p.name: p.read_bytes() for p in run.path.iterdir() if p.is_file()}
    process = holder(run.path)
    text = torchrun("finetune", "--resume", str(run.path))
    assert f"being written by another dptext process (pid {process.pid})" in text, text[-3000:]
    assert {p.name: p.read_bytes() for p in run.path.iterdir() if p.is_file()} == before


@pytest.mark.slow
def test_two_real_finetune_processes_into_one_folder(tmp_path):
    """Two `dptext finetune --out o` started together: exactly one trains, the other says so and exits 2."""
    args = finetune(tmp_path, "train.max_steps=4")
    commands = [[sys.executable, "-m", "dptext", *args[:-2], "--out", str(tmp_path / "o")] for _ in range(2)]
    processes = [subprocess.Popen(c, env=env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for c in commands]
    results = [(p.wait(timeout=240), p.stderr.read()) for p in processes]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    refusal = next(err for code, err in results if code == 2).strip().splitlines()
    assert len(refusal) == 1 and ("being written by another dptext process" in refusal[0]
                                  or "already exists and is not empty" in refusal[0]), refusal
    steps = [r["step"] for r in runs.RunDir(tmp_path / "o").read_metrics() if "epsilon" in r]
    assert steps == sorted(set(steps)) and len(steps) >= 1  # one run's rows, none twice


# --------------------------------------------------------------------------- checkpoints you can trust

def saved(tmp_path, steps=(10, 20)):
    run = make_run(tmp_path)
    for step in steps:
        run.save_checkpoint({"weights": torch.full((3,), float(step))}, step=step)
    return run


def test_a_truncated_newest_checkpoint_falls_back_to_the_older_one_and_says_so(tmp_path):
    run = saved(tmp_path)
    newest = run.checkpoint_dir / "step-00000020.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    said = []
    state = run.load_checkpoint(say=said.append)
    assert state["step"] == 10 and torch.equal(state["weights"], torch.full((3,), 10.0))
    assert len(said) == 1 and "step-00000010.pt" in said[0] and "step-00000020.pt" in said[0]


def test_a_checkpoint_of_random_bytes_is_skipped_and_none_usable_is_one_sentence(tmp_path):
    run = saved(tmp_path)
    for path in run.checkpoint_dir.glob("step-*.pt"):
        path.write_bytes(os.urandom(path.stat().st_size))
    with pytest.raises(UserError, match="No checkpoint .* can be used") as error:
        run.load_checkpoint()
    assert "step-00000020.pt" in str(error.value) and "\n" not in str(error.value)


def test_a_checkpoint_without_checksum_that_cannot_load_is_skipped(tmp_path):
    run = saved(tmp_path)  # checkpoints from before checksums: loading them is the check
    for path in run.checkpoint_dir.glob("*.sha256"):
        path.unlink()
    (run.checkpoint_dir / "step-00000020.pt").write_bytes(b"not a checkpoint")
    assert run.load_checkpoint()["step"] == 10


def test_latest_naming_a_missing_file_falls_back_never_restarts_from_zero(tmp_path):
    run = saved(tmp_path)
    (run.checkpoint_dir / runs.LATEST).write_text("step-00000099.pt\n")
    said = []
    assert run.load_checkpoint(say=said.append)["step"] == 20
    assert "step-00000099.pt" in said[0] and "missing" in said[0]
    for path in run.checkpoint_dir.glob("step-*"):
        path.unlink()
    with pytest.raises(UserError, match="LATEST.* names step-00000099.pt, which is missing"):
        run.load_checkpoint()


def test_a_run_without_latest_still_finds_its_checkpoints(tmp_path):
    run = saved(tmp_path)
    (run.checkpoint_dir / runs.LATEST).unlink()
    assert run.load_checkpoint()["step"] == 20


@pytest.mark.slow
def test_resume_of_a_real_run_with_a_truncated_newest_checkpoint(tmp_path, capsys):
    args = finetune(tmp_path, "train.max_steps=3", "train.checkpoint_every=1")
    code, err = cli(args, capsys)
    assert code == 0, err
    run = runs.RunDir(tmp_path / "run")
    (run.path / runs.RESULT).unlink()  # as if stopped before finishing
    newest = sorted(run.checkpoint_dir.glob("step-*.pt"))[-1]
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    capsys.readouterr()
    code, err = cli(["finetune", "--resume", str(run.path)], capsys)
    assert code == 0, err
    assert "Resuming from step-00000002.pt, the newest intact checkpoint: step-00000003.pt" in err
    assert run.load_result()["steps_run"] == 3


def test_a_damaged_ledger_is_one_sentence_in_account(tmp_path, capsys):
    run = make_run(tmp_path)
    (run.path / runs.LEDGER).write_text('{"format": "dptext-ledger-1", "runs": [')
    line = refused(["account", str(run.path)], capsys, "ledger.json", "damaged")
    assert "privacy ledger" in line
    (run.path / runs.LEDGER).write_bytes(b"\xff\xfe\x00garbage")
    refused(["account", str(run.path)], capsys, "damaged")


# --------------------------------------------------------------------------- a full disk

def test_a_full_disk_while_checkpointing_is_one_sentence_and_the_run_resumes(tmp_path, capsys, monkeypatch):
    real_save, calls = torch.save, []

    def fill_disk(obj, handle, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second checkpoint: torch's zip writer reports the full disk its own way
            handle.write(b"PK\x03\x04partial")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4288 vs 4186")
        return real_save(obj, handle, *args, **kwargs)

    monkeypatch.setattr(torch, "save", fill_disk)
    code, err = cli(finetune(tmp_path, "train.max_steps=2", "train.checkpoint_every=1"), capsys)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]  # after the progress lines
    assert code == 2 and len(errors) == 1 and err.strip().endswith(errors[0]), err
    assert "No space left on the device while writing" in errors[0] and "step-00000002.pt" in errors[0]
    assert "--resume" in errors[0] and "enforce fail" not in errors[0]
    run = runs.RunDir(tmp_path / "run")
    assert sorted(p.name for p in run.checkpoint_dir.iterdir()) == [runs.LATEST, "step-00000001.pt",
                                                                   "step-00000001.pt.sha256"]
    monkeypatch.setattr(torch, "save", real_save)  # space freed
    code, err = cli(["finetune", "--resume", str(run.path)], capsys)
    assert code == 0, err
    assert run.load_result()["steps_run"] == 2


def test_a_full_disk_while_logging_leaves_no_torn_line(tmp_path, monkeypatch):
    run = make_run(tmp_path)
    run.log_metrics({"step": 1})
    real_fsync = os.fsync

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(UserError, match="No space left on the device while writing .*metrics.jsonl"):
        run.log_metrics({"step": 2})
    monkeypatch.setattr(os, "fsync", real_fsync)
    run.log_metrics({"step": 3})
    assert [r["step"] for r in run.read_metrics()] == [1, 3]
