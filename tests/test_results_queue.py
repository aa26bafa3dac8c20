"""benchmarks/results_queue.py: job files, resume/skip decisions, and a real queue of tiny runs."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


queue = _load("results_queue")


def test_job_file_parsing_substitutes_data_and_runs_and_rejects_bad_lines(tmp_path):
    jobs = tmp_path / "jobs.txt"
    jobs.write_text("# a comment\n\natis  recipes/atis.yaml data.path={data}/atis  # trailing\n"
                    "# disabled recipes/x.yaml\nsst2 recipes/sst2.yaml 'name=with space' data.path={runs}/split\n"
                    "snips recipes/snips.yaml env:DPTEXT_ALLOCATOR=default train.learning_rate=5e-3 env:A=b=c\n")
    parsed = queue.read_jobs(jobs, Path("/d"), Path("/r"))
    assert parsed == [queue.Job("atis", "recipes/atis.yaml", ("data.path=/d/atis",)),
                      queue.Job("sst2", "recipes/sst2.yaml", ("name=with space", "data.path=/r/split")),
                      queue.Job("snips", "recipes/snips.yaml", ("train.learning_rate=5e-3",),
                                env=(("DPTEXT_ALLOCATOR", "default"), ("A", "b=c")))]
    jobs.write_text("atis recipes/atis.yaml notanoverride\n")
    with pytest.raises(ValueError, match="jobs.txt:1"):
        queue.read_jobs(jobs, Path("/d"))
    jobs.write_text("a r.yaml\na s.yaml\n")
    with pytest.raises(ValueError, match="unique"):
        queue.read_jobs(jobs, Path("/d"))


def _finish(runs: Path, name: str, **metrics) -> None:
    (runs / name).mkdir(parents=True)
    (runs / name / "result.json").write_text(json.dumps({"metrics": metrics}))


def test_a_search_line_decides_the_value_of_the_jobs_below_it_once_all_its_runs_have_finished(tmp_path):
    jobs, runs = tmp_path / "jobs.txt", tmp_path / "runs"
    jobs.write_text("final-lr2e-3 r.yaml train.learning_rate=2e-3\n"
                    "@search lr tune-lr{value} accuracy 5e-4 1e-3 2e-3\n"
                    "final-lr{lr} r.yaml train.learning_rate={lr} data.path={data}/x\n"
                    "eps3-lr{lr} r.yaml train.learning_rate={lr} privacy.target_epsilon=3\n"
                    "@search ser atis-{value} ser a b\nlast-{ser} r.yaml\n")
    _finish(runs, "tune-lr5e-4", accuracy=83.6)
    _finish(runs, "tune-lr1e-3", accuracy=85.1)
    waiting = queue.read_jobs(jobs, Path("/d"), runs)
    assert [(j.name, j.waiting_for) for j in waiting] == [
        ("final-lr2e-3", None), ("final-lr{lr}", "lr"), ("eps3-lr{lr}", "lr"), ("last-{ser}", "ser")]
    assert queue.state_of(waiting[1], runs) == "waiting"
    assert queue.next_job([jobs], runs, Path("/d"), {"final-lr2e-3"}) is None  # waiting jobs never start

    _finish(runs, "tune-lr2e-3", accuracy=84.0)
    _finish(runs, "atis-a", ser=7.0)
    _finish(runs, "atis-b", ser=6.5)
    decided = queue.read_jobs(jobs, Path("/d"), runs)
    assert decided[1:] == [queue.Job("final-lr1e-3", "r.yaml", ("train.learning_rate=1e-3", "data.path=/d/x")),
                           queue.Job("eps3-lr1e-3", "r.yaml", ("train.learning_rate=1e-3", "privacy.target_epsilon=3")),
                           queue.Job("last-b", "r.yaml", ())]  # highest accuracy; lowest SER

    (runs / "tune-lr1e-3" / "result.json").write_text(json.dumps({"metrics": {"accuracy": 80.0}}))
    chosen = queue.read_jobs(jobs, Path("/d"), runs)  # 2e-3 wins: its final run is the first line's, run once
    assert [j.name for j in chosen] == ["final-lr2e-3", "eps3-lr2e-3", "last-b"]

    jobs.write_text("@search lr tune-lr accuracy 5e-4\n")
    with pytest.raises(ValueError, match="jobs.txt:1"):
        queue.read_jobs(jobs, Path("/d"), runs)
    jobs.write_text("@search lr tune-lr{value} f1 5e-4 1e-3 2e-3\n")
    with pytest.raises(ValueError, match="no metric 'f1'"):
        queue.read_jobs(jobs, Path("/d"), runs)


def test_new_started_and_finished_jobs_get_the_right_command(tmp_path):
    job = queue.Job("run1", "recipes/quickstart.yaml", ("train.max_steps=1",))
    command = queue.command_for(job, tmp_path, "py")
    assert command[:3] == ["nice", "-n", "19"] and command[-2:] == ["--out", str(tmp_path / "run1")]
    assert str(queue.CODE / "recipes/quickstart.yaml") in command and "train.max_steps=1" in command
    (tmp_path / "run1").mkdir()
    (tmp_path / "run1" / "resolved.yaml").write_text("name: x\n")
    assert queue.state_of(job, tmp_path) == "started"
    assert queue.command_for(job, tmp_path, "py")[-2:] == ["--resume", str(tmp_path / "run1")]
    (tmp_path / "run1" / "result.json").write_text("{}")
    assert queue.state_of(job, tmp_path) == "finished"
    assert queue.next_job([], tmp_path, tmp_path, set()) is None


def test_distill_and_synth_jobs_name_their_command_and_synth_continues_its_own_folder(tmp_path):
    jobs = tmp_path / "jobs.txt"
    jobs.write_text("t recipes/teacher.yaml data.path={data}/a\n"
                    "s synth {runs}/t --n=20 --check-training-copies env:A=b\n"
                    "d distill recipes/distill.yaml distill.synthetic={runs}/s\n")
    parsed = queue.read_jobs(jobs, Path("/d"), Path("/r"))
    assert [job.command for job in parsed] == ["finetune", "synth", "distill"]
    assert parsed[1] == queue.Job("s", "/r/t", ("--n=20", "--check-training-copies"), None, (("A", "b"),), "synth")
    runs = tmp_path / "runs"
    synth, distill = parsed[1], parsed[2]
    fresh = queue.command_for(synth, runs, "py")
    assert fresh[3:] == ["py", "-m", "dptext", "synth", "/r/t", "--n=20", "--check-training-copies", "--out",
                         str(runs / "s")]
    (runs / "s").mkdir(parents=True)
    (runs / "s" / "plan.json").write_text("{}")  # an interrupted synth: started, and the same command continues it
    assert queue.state_of(synth, runs) == "started" and queue.command_for(synth, runs, "py") == fresh
    (runs / "s" / "result.json").write_text("{}")  # not synth's end marker
    assert queue.state_of(synth, runs) == "started"
    (runs / "s" / "provenance.json").write_text("{}")
    assert queue.state_of(synth, runs) == "finished"
    assert queue.command_for(distill, runs, "py")[3:7] == ["py", "-m", "dptext", "distill"]
    (runs / "d").mkdir()
    (runs / "d" / "resolved.yaml").write_text("name: x\n")
    assert queue.command_for(distill, runs, "py")[-2:] == ["--resume", str(runs / "d")]
    for bad in ("s synth {runs}/t n=20\n", "d distill recipes/distill.yaml --flag\n"):
        jobs.write_text(bad)
        with pytest.raises(ValueError, match="jobs.txt:1"):
            queue.read_jobs(jobs, Path("/d"), Path("/r"))


def test_list_shows_a_started_jobs_last_progress_line(tmp_path, capsys):
    assert queue.last_progress(tmp_path / "absent.log") == ""
    log = tmp_path / "run1.log"
    log.write_text("Run directory: /r\ntraining: 1/9 (3s eta 24s) loss=2.0\ntraining: 2/9 (6s eta 21s) loss=1.9\r"
                   "evaluating: 4/8 (1s eta 1s)\nwarning: something\n")
    assert queue.last_progress(log) == "evaluating: 4/8 (1s eta 1s)"
    jobs = tmp_path / "jobs.txt"
    jobs.write_text("run1 recipes/quickstart.yaml\nrun2 recipes/quickstart.yaml\n")
    (tmp_path / "run1").mkdir()
    (tmp_path / "run1" / "resolved.yaml").write_text("name: x\n")
    assert queue.main([str(jobs), "--runs", str(tmp_path), "--list"]) == 0
    assert capsys.readouterr().out.splitlines() == ["started   run1  evaluating: 4/8 (1s eta 1s)", "new       run2"]


def test_every_job_in_the_job_list_loads_as_a_recipe_with_its_overrides():
    """A misspelt override in benchmarks/jobs.txt would fail only when its job starts, hours into the queue."""
    from dptext.config import load_recipe

    jobs = queue.read_jobs(BENCHMARKS / "jobs.txt", Path("/d"), Path("/r"))
    assert any(job.command == "distill" for job in jobs) and any(job.command == "synth" for job in jobs)
    import typer.main

    from dptext.cli.app import build_app

    synth = next(c for c in typer.main.get_command(build_app()).commands.values() if c.name == "synth")
    synth_options = {option for param in synth.params for option in param.opts}
    for job in jobs:
        if job.command == "synth":
            unknown = [word for word in job.overrides if word.split("=", 1)[0] not in synth_options]
            assert not unknown, f"{job.name}: dptext synth has no option {unknown}"
        elif job.waiting_for is None:
            load_recipe(queue.CODE / job.recipe, list(job.overrides))


@pytest.mark.slow  # four dptext processes: ~1 min on an idle 2-core machine, 11 min on a busy one
def test_queue_runs_resumes_and_skips(shared_data, tmp_path):
    jobs = tmp_path / "jobs.txt"
    common = ("model.name=tiny-bert data.dataset=sst2 data.path={data}/sst2 task.type=classification "
              "eval.split=validation data.max_train_examples=24 data.max_eval_examples=4 data.max_length=16 "
              "train.batch_size=8 train.max_steps=2 privacy.enabled=false")
    jobs.write_text(f"first recipes/quickstart.yaml {common} env:DPTEXT_ALLOCATOR=default\n"
                    f"broken recipes/quickstart.yaml {common} train.batch_size=0\n")
    runs = tmp_path / "runs"
    argv = [str(jobs), "--runs", str(runs), "--data", str(shared_data), "--python", sys.executable]
    assert queue.main(argv) == 1  # one job failed: logged, the queue went on and finished
    assert json.loads((runs / "first" / "result.json").read_text())["steps_run"] == 2
    assert json.loads((runs / "first" / "provenance.json").read_text())["allocator"] == "glibc defaults"  # env:
    log = (runs / "queue.log").read_text()
    assert "done first" in log and "FAILED broken" in log
    # a restart skips the finished job and retries the failed one (it still fails)
    (runs / "queue.log").unlink()
    queue.main(argv)
    log = (runs / "queue.log").read_text()
    assert "start first" not in log and "start broken" in log


def test_jobs_see_the_checkout_first_and_keep_a_pythonpath_set_outside():
    """On the lent GPU machine the missing packages sit in a pip --target folder on PYTHONPATH; replacing it with
    the checkout made every DP job fail at its first accounting step (No module named 'prv_accountant')."""
    env = queue.job_environment({"PYTHONPATH": "/tmp/site", "HOME": "/root"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(queue.CODE), "/tmp/site"] and env["HOME"] == "/root"
    assert queue.job_environment({})["PYTHONPATH"] == str(queue.CODE)
