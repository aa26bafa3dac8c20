"""Launch a test file as 2 gloo processes with torchrun's environment (rank r runs ``python FILE OUT``)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch


@contextmanager
def check_fails_on_rank_1(rank: int):
    """The per-step invariant forced to fail on rank 1 only, as when the examples that break it sit on one rank."""
    from dptext.privacy.proof import step_checks

    real = step_checks.clipping.check_clipped_sums
    if rank == 1:
        step_checks.clipping.check_clipped_sums = lambda *args: (None, "forced on rank 1")
    try:
        yield
    finally:
        step_checks.clipping.check_clipped_sums = real


@contextmanager
def hook_added_on_rank_1(rank: int, model):
    """A forward hook added to the first linear layer on rank 1 only, after the engine planned (a debugging hook on
    one process): that rank's use check fails, the other rank's passes."""
    handle = None
    if rank == 1:
        layer = next(module for module in model.modules() if isinstance(module, torch.nn.Linear))
        handle = layer.register_forward_hook(lambda module, args, output: None)
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


FAILURES = {"invariant": "forced on rank 1", "hook": "Forward hooks of layer"}  # a failure -> its words


def fails_on_rank_1(failure: str, rank: int, model):
    """Rank 1's check of one micro-batch fails: the per-step invariant, or the check of its recorded uses."""
    return check_fails_on_rank_1(rank) if failure == "invariant" else hook_added_on_rank_1(rank, model)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_two_ranks(script: str, out: Path, timeout: float, ranks: int = 2, env: dict | None = None) -> list:
    """Run ``script`` as ranks 0 and 1 (or ``ranks`` of them; a hang fails instead of blocking CI); each saves
    ``out/rank{r}.pt``. ``env``: more environment variables for every rank."""
    env = {**os.environ, "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", **(env or {})}
    entry = str(Path(__file__).with_name("rank_entry.py"))  # ends each rank past the interpreter's teardown
    procs = [subprocess.Popen([sys.executable, entry, script, str(out)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(ranks)]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(ranks)]


# A worker's own words when it dies: a Python exception, or a C++ abort (gloo's "terminate called ... what(): ...").
WORKER_ERROR = re.compile(r"terminate called|what\(\)|\w+(Error|Exception)\b|Fatal Python error|Aborted")


def torchrun_failure(done: subprocess.CompletedProcess) -> str:
    """Why a torchrun run failed, the workers' error lines last: CI shows only the tail of a failure, and
    torchrun's closing summary (exit codes and signals, no reasons) would otherwise fill it."""
    text = done.stdout + done.stderr
    errors = [line for line in dict.fromkeys(text.splitlines())
              if WORKER_ERROR.search(line) and not line.strip().startswith("error_file")]
    return text[-3000:] + "\n--- the workers' error lines ---\n" + "\n".join(errors[-20:])


def run_process_group(command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` for torchrun: on a timeout the whole process group goes, not only torchrun itself,
    whose orphaned workers would otherwise wait in the rendezvous for half an hour."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


CASES_VARIABLE = "KEPT_CASES"  # the cases a red-team file's ranks run (its __main__ reads it)


def run_cases(script: str, default_timeout: float, out: Path, cases: list[str], timeout: float | None = None) -> list:
    """``script`` as 2 gloo ranks running ``cases`` (bind ``script`` and its timeout with functools.partial)."""
    return run_two_ranks(script, out, timeout or default_timeout, env={CASES_VARIABLE: ",".join(cases)})
