"""Benchmark of privacy accounting: a 10,000-step query and calibration, against dp-accounting.

Targets (issue 4): a 10,000-step ε query with every method < 2 s, a calibration < 5 s.

    .venv/bin/python benchmarks/bench_accounting.py [--repeat 3] [--json]

Every timing is wall-clock in this one process, with the RDP cache cleared before each
repetition (so no repetition profits from an earlier one); the min and median of the
repetitions are reported, next to the same computation by dp-accounting when it is
installed (RDP accountant; PLD accountant as the peer of PRV). The command-line timing
runs `dptext account` in a fresh interpreter, imports included. The machine and its load
are printed, since shared cores make single numbers noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

Q, SIGMA, STEPS, DELTA = 0.01, 1.0, 10_000, 1e-5
CAL_EPS, CAL_Q, CAL_STEPS = 3.0, 0.02, 1000


def timed(work: Callable[[], object], repeat: int) -> dict[str, float]:
    from dptext.accounting import rdp

    seconds = []
    for _ in range(repeat):
        rdp._rdp_cached.cache_clear()
        start = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - start)
    return {"min_s": min(seconds), "median_s": statistics.median(seconds)}


def query_all_methods() -> object:
    from dptext.accounting.epsilon import compute_all
    from dptext.accounting.events import StepRun

    return compute_all([StepRun(Q, SIGMA, STEPS)], DELTA)


def calibrate(method: str, steps: int = CAL_STEPS) -> Callable[[], object]:
    from dptext.accounting.calibrate import calibrate_noise_multiplier

    return lambda: calibrate_noise_multiplier(CAL_EPS, DELTA, CAL_Q, steps, method)


def peer_query() -> dict[str, Callable[[], object]]:
    try:
        from dp_accounting import dp_event
        from dp_accounting.pld import pld_privacy_accountant
        from dp_accounting.rdp import rdp_privacy_accountant
    except ImportError:
        return {}
    event = dp_event.PoissonSampledDpEvent(Q, dp_event.GaussianDpEvent(SIGMA))

    def run(accountant) -> float:
        accountant.compose(event, STEPS)
        return accountant.get_epsilon(DELTA)

    return {"dp-accounting RDP": lambda: run(rdp_privacy_accountant.RdpAccountant()),
            "dp-accounting PLD (1e-3 grid)": lambda: run(
                pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3))}


def cli_seconds(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "dptext", "account", *args, "--json"], check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="Print the results as JSON.")
    args = parser.parse_args()

    import logging

    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's convergence chatter
    results: dict[str, dict[str, float]] = {}
    from dptext.accounting.epsilon import METHODS

    results[f"query {STEPS} steps, {'+'.join(METHODS)} (ours)"] = timed(query_all_methods, args.repeat)
    for name, work in peer_query().items():
        results[f"query {STEPS} steps, {name}"] = timed(work, args.repeat)
    for method in METHODS:
        results[f"calibrate ε={CAL_EPS:g} q={CAL_Q} S={CAL_STEPS} {method}"] = timed(calibrate(method), args.repeat)
    results[f"calibrate ε={CAL_EPS:g} q={CAL_Q} S={STEPS} prv"] = timed(calibrate("prv", STEPS), args.repeat)
    query_cli = ["--sigma", str(SIGMA), "-q", str(Q), "--steps", str(STEPS), "--delta", str(DELTA)]
    calibrate_cli = ["--eps", str(CAL_EPS), "-q", str(CAL_Q), "--steps", str(CAL_STEPS), "--delta", str(DELTA)]
    results["CLI `dptext account` 10,000-step query (fresh process)"] = {"min_s": cli_seconds(query_cli)}
    results[f"CLI `dptext account` calibration, {len(METHODS)} methods (fresh process)"] = {
        "min_s": cli_seconds(calibrate_cli)}

    machine = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
               "load_average_1m": os.getloadavg()[0], "repeat": args.repeat}
    if args.json:
        print(json.dumps({"machine": machine, "results": results}, indent=2))
        return
    print(f"machine: {machine}")
    width = max(len(name) for name in results)
    for name, timing in results.items():
        median = f"  median {timing['median_s']:.3f} s" if "median_s" in timing else ""
        print(f"{name.ljust(width)}  min {timing['min_s']:.3f} s{median}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
