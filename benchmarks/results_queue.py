"""Run the long result jobs one after another, in the background, resumably.

    nohup python benchmarks/results_queue.py benchmarks/jobs.txt >/dev/null 2>&1 &

A job file has one job a line, ``NAME [COMMAND] RECIPE [key=value ...] [env:VARIABLE=value ...]`` (``#`` starts a
comment; COMMAND is ``finetune`` when left out, or ``distill`` (a distill recipe), or ``synth``, whose line is
``NAME synth TEACHER_RUN [--option=value | --flag ...]``; ``{data}`` in a value is replaced by ``--data``, the
shared data folder, and ``{runs}`` by ``--runs``, for data a benchmark script wrote there, such as the SST-2
tuning split; an ``env:`` word sets an environment variable of that job's process, fresh or resumed, e.g.
``env:DPTEXT_ALLOCATOR=default``). A search line
``@search NAME RUN METRIC VALUE ...`` makes ``{NAME}`` in the lines below it stand for the VALUE whose
run (RUN with ``{value}`` in place of that value) scored best on METRIC in its result.json (lowest for
SER and perplexity, highest otherwise); until every one of those runs has finished, a job that uses
``{NAME}`` waits (skipped, not failed), so a job after a search runs at the value the search chose. A job
whose name comes out the same as an earlier job's is that job (it is not run twice). For each job, in
file order:

* ``RUNS/NAME/result.json`` exists (``provenance.json`` for synth): finished, skipped;
* ``RUNS/NAME`` holds a run (``resolved.yaml``; ``plan.json`` for synth): ``dptext COMMAND --resume RUNS/NAME``
  (synth: the same command again, which continues its folder);
* otherwise: ``dptext COMMAND RECIPE overrides --out RUNS/NAME``;
* it uses an undecided search: waiting, skipped.

Each job runs under ``nice -n 19`` (other people need the 2 cores) with the dptext of the checkout
this script lives in on ``PYTHONPATH``, so the code that runs is the commit that
``provenance.json`` records, whatever happens to other checkouts. Its output goes to
``RUNS/NAME.log``; the queue's own log is ``RUNS/queue.log``. The job files are re-read after every
job, so a job appended (or uncommented) while the queue runs is picked up. A failed job is logged
and skipped; restarting the queue retries it from its last checkpoint. Only one queue runs per
RUNS folder (a lock file); ``--wait`` queues behind the running one instead of exiting.

Restart it at any time (after a machine restart, after killing it): it picks up where it was.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fcntl
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CODE = Path(__file__).resolve().parent.parent
DEFAULT_RUNS = Path("/work/results-runs")
DEFAULT_DATA = CODE.parent / "shared" / "data"


LOWER_IS_BETTER = {"ser", "perplexity"}
SEARCH = "@search"
ENV = "env:"
COMMANDS = ("finetune", "distill", "synth")  # the dptext subcommands a job may run (finetune when not named)
# What marks a job's folder finished, and started (resumable), per command: synth writes provenance.json last and
# continues an unfinished folder when run again; finetune and distill write result.json last and take --resume.
FINISHED = {"finetune": "result.json", "distill": "result.json", "synth": "provenance.json"}
STARTED = {"finetune": "resolved.yaml", "distill": "resolved.yaml", "synth": "plan.json"}


@dataclass(frozen=True)
class Job:
    name: str
    recipe: str  # for synth: the teacher run
    overrides: tuple[str, ...]  # key=value for finetune and distill, --options for synth
    waiting_for: str | None = None  # the search this job's values come from, while it is undecided
    env: tuple[tuple[str, str], ...] = ()  # environment variables of the job's process (its env: words)
    command: str = "finetune"


def finished_scores(runs: Path, run_names: list[str], metric: str) -> list[float] | None:
    """Each run's ``metric`` from its result.json; None until every run has finished."""
    results = [runs / name / "result.json" for name in run_names]
    if not all(result.is_file() for result in results):
        return None
    scores = [json.loads(result.read_text())["metrics"].get(metric) for result in results]
    if None in scores:
        raise ValueError(f"{results[scores.index(None)]} has no metric {metric!r} to choose by")
    return scores


def best_of(values: list[str] | tuple[str, ...], scores: list[float], metric: str) -> str:
    """The value with the best score (lowest for LOWER_IS_BETTER metrics); a tie keeps the value listed first."""
    sign = 1 if metric in LOWER_IS_BETTER else -1
    return min(zip(values, scores), key=lambda pair: sign * pair[1])[0]


def best_value(runs: Path, run_names: list[str], values: list[str] | tuple[str, ...], metric: str) -> str | None:
    """The value whose run scored best on ``metric`` (its result.json); None until every run has finished."""
    scores = finished_scores(runs, run_names, metric)
    return None if scores is None else best_of(values, scores, metric)


def read_jobs(path: Path, data: Path, runs: Path = DEFAULT_RUNS) -> list[Job]:
    """The jobs of one job file, in order; raises ValueError naming a malformed line."""
    jobs, written, chosen = [], [], {}  # written: the names as the file spells them, before any search resolves
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        words = [w.replace("{data}", str(data)).replace("{runs}", str(runs)) for w in shlex.split(line, comments=True)]
        if not words:
            continue
        if words[0] == SEARCH:
            if len(words) < 5 or "{value}" not in words[2]:
                raise ValueError(f"{path}:{number}: expected '{SEARCH} NAME RUN METRIC VALUE ...' with {{value}} in "
                                 f"RUN, got {line.strip()!r}")
            values = words[4:]
            chosen[words[1]] = best_value(runs, [words[2].replace("{value}", v) for v in values], values, words[3])
            continue
        command = words.pop(1) if len(words) > 1 and words[1] in COMMANDS else "finetune"
        options_ok = (lambda w: w.startswith("--")) if command == "synth" else (lambda w: "=" in w)
        if len(words) < 2 or any(not (w.startswith(ENV) or options_ok(w)) for w in words[2:]):
            expected = ("NAME synth TEACHER_RUN [--option=value ...]" if command == "synth"
                        else f"NAME {'distill ' if command == 'distill' else ''}RECIPE [key=value ...]")
            raise ValueError(f"{path}:{number}: expected '{expected}', got {line.strip()!r}")
        written.append(words[0])
        used = [name for name in chosen if "{" + name + "}" in line]
        undecided = next((name for name in used if chosen[name] is None), None)
        for name in used:
            if chosen[name] is not None:
                words = [w.replace("{" + name + "}", chosen[name]) for w in words]
        if used and any(words[0] == job.name for job in jobs):
            continue  # the search chose a value an earlier line already runs
        env = tuple(tuple(w[len(ENV):].split("=", 1)) for w in words[2:] if w.startswith(ENV))
        overrides = tuple(w for w in words[2:] if not w.startswith(ENV))
        jobs.append(Job(words[0], words[1], overrides, undecided, env, command))
    duplicated = {n for n in written if written.count(n) > 1}
    if duplicated:
        raise ValueError(f"{path}: job names must be unique (they name the run folders): {sorted(duplicated)}")
    return jobs


def state_of(job: Job, runs: Path) -> str:
    if job.waiting_for is not None:
        return "waiting"
    run = runs / job.name
    if (run / FINISHED[job.command]).is_file():
        return "finished"
    if (run / STARTED[job.command]).is_file():
        return "started"
    return "new"


def command_for(job: Job, runs: Path, python: str) -> list[str]:
    run = runs / job.name
    base = ["nice", "-n", "19", python, "-m", "dptext", job.command]
    if job.command == "synth":  # its folder is its resume state: the same command continues it
        return base + [job.recipe, *job.overrides, "--out", str(run)]
    if state_of(job, runs) == "started":
        return base + ["--resume", str(run)]
    recipe = Path(job.recipe) if Path(job.recipe).is_absolute() else CODE / job.recipe
    return base + [str(recipe), *job.overrides, "--out", str(run)]


def log(runs: Path, message: str) -> None:
    line = f"{dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')} {message}\n"
    with open(runs / "queue.log", "a") as handle:
        handle.write(line)


def next_job(job_files: list[Path], runs: Path, data: Path, failed: set[str]) -> Job | None:
    for path in job_files:
        for job in read_jobs(path, data, runs):
            if job.name not in failed and state_of(job, runs) in ("new", "started"):
                return job
    return None


def job_environment(outside: dict[str, str]) -> dict[str, str]:
    """The jobs' environment: this checkout first on PYTHONPATH, so the code that runs is the recorded commit; a
    PYTHONPATH set outside (packages installed with ``pip --target`` on a lent GPU machine) stays, behind it."""
    path = os.pathsep.join(p for p in (str(CODE), outside.get("PYTHONPATH", "")) if p)
    return {**outside, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def run_queue(job_files: list[Path], runs: Path, data: Path, python: str) -> int:
    """Run every unfinished job; returns how many failed."""
    failed: set[str] = set()
    env = job_environment(os.environ)
    while (job := next_job(job_files, runs, data, failed)) is not None:
        command = command_for(job, runs, python)
        settings = "".join(f"{name}={value} " for name, value in job.env)
        log(runs, f"start {job.name} ({state_of(job, runs)}): {settings}{shlex.join(command)}")
        started = time.monotonic()
        (runs / job.name).parent.mkdir(parents=True, exist_ok=True)  # names may hold a folder: distill-long/teacher
        with open(runs / f"{job.name}.log", "a") as out:
            code = subprocess.run(command, cwd=CODE, env={**env, **dict(job.env)}, stdout=out,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
        took = time.monotonic() - started
        if code == 0 and state_of(job, runs) == "finished":
            log(runs, f"done {job.name} in {took:.0f} s")
        else:
            failed.add(job.name)
            log(runs, f"FAILED {job.name} (exit {code}) after {took:.0f} s; see {runs / job.name}.log")
    waiting = sorted(job.name for path in job_files for job in read_jobs(path, data, runs) if job.waiting_for)
    log(runs, f"queue empty ({len(failed)} failed: {sorted(failed)}; {len(waiting)} waiting for a search: {waiting})")
    return len(failed)


def last_progress(log: Path) -> str:
    """The last progress line a job printed ("training: 94/197 (1920s eta 2354s) ..."), for ``--list``."""
    if not log.is_file():
        return ""
    with open(log, "rb") as handle:
        handle.seek(max(0, log.stat().st_size - 4096))
        lines = handle.read().decode("utf-8", "replace").replace("\r", "\n").splitlines()
    return next((line.strip() for line in reversed(lines) if "/" in line and ":" in line and "eta" in line), "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jobs", nargs="+", type=Path, help="job files, run in the order given")
    parser.add_argument("--runs", type=Path, default=DEFAULT_RUNS, help="folder of the run directories")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="replaces {data} in job lines")
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs dptext")
    parser.add_argument("--wait", action="store_true", help="wait for a running queue instead of exiting")
    parser.add_argument("--list", action="store_true", help="print each job's state and exit")
    args = parser.parse_args(argv)
    args.runs.mkdir(parents=True, exist_ok=True)
    for path in args.jobs:  # a malformed file fails now, not after hours of the jobs before it
        read_jobs(path, args.data, args.runs)
    if args.list:
        for path in args.jobs:
            for job in read_jobs(path, args.data, args.runs):
                state = state_of(job, args.runs)
                progress = f"  {last_progress(args.runs / f'{job.name}.log')}" if state == "started" else ""
                print(f"{state:9} {job.name}{progress}")
        return 0
    lock = open(args.runs / "queue.lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | (0 if args.wait else fcntl.LOCK_NB))
    except BlockingIOError:
        lock.seek(0)
        print(f"A queue already runs on {args.runs} (pid {lock.read().strip() or '?'}); pass --wait to run "
              "after it.", file=sys.stderr)
        return 1
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    log(args.runs, f"queue pid {os.getpid()} code {CODE} jobs {' '.join(map(str, args.jobs))}")
    return 1 if run_queue(args.jobs, args.runs, args.data, args.python) else 0


if __name__ == "__main__":
    sys.exit(main())
