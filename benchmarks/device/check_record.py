"""The GPU check's records under $OUT (benchmarks/device/gpu_check.sh), each rewritten atomically as the check goes.

    python benchmarks/device/check_record.py start OUT --device cuda [--tiny]    # meta.json: machine, commit
    python benchmarks/device/check_record.py step OUT NAME RC SECONDS LIMIT [--note TEXT]
    python benchmarks/device/check_record.py bench OUT FOLDER/bench.json      # appended to OUT/bench.json

meta.json holds the device (torch's name for it and nvidia-smi's line), the git revision, the package versions,
where smollm2-135m's weights came from, and per step its exit status, wall seconds and time limit; bench.json
holds every ``dptext bench-memory`` report of the check in one list, so that $OUT stays a few files (a lent
machine returns at most eight).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dptext.runs import atomic_write_json  # noqa: E402  (runs from a checkout without installing)

STATUS = {0: "ok", 124: "timed out", 137: "killed after its time limit"}


def read(path: Path, default: dict) -> dict:
    return json.loads(path.read_text()) if path.exists() else default


def nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    done = subprocess.run(query, capture_output=True, text=True, timeout=30)
    return done.stdout.strip() or done.stderr.strip()


def smollm2_weights() -> str:
    from dptext.paths import models_cache

    folder = models_cache() / "smollm2-135m"
    if (folder / "RANDOM_WEIGHTS").exists():
        return "random (SmolLM2-135M's config and tokenizer; time and memory do not depend on the values)"
    return "pretrained (converted from the GGUF)" if (folder / "config.json").exists() else "not prepared"


def start(out: Path, device: str, tiny: bool) -> None:
    import torch

    from dptext.provenance import provenance

    meta = {"check": "issue 44 GPU check (benchmarks/device/gpu_check.sh)", "device": device, "tiny": tiny,
            "provenance": provenance(), "torch": torch.__version__, "started_unix": time.time(), "steps": {}}
    if not tiny:
        meta["smollm2_weights"] = smollm2_weights()
    if device == "cuda":
        meta.update(device_name=torch.cuda.get_device_name(0), cuda=torch.version.cuda, nvidia_smi=nvidia_smi(),
                    device_memory_bytes=torch.cuda.get_device_properties(0).total_memory)
    atomic_write_json(out / "meta.json", meta)


def step(out: Path, name: str, rc: int, seconds: float, limit: float, note: str | None) -> None:
    meta = read(out / "meta.json", {"steps": {}})
    status = STATUS.get(rc, f"failed (exit status {rc})")
    meta["steps"][name] = {"status": note or status, "rc": rc, "seconds": seconds, "limit_seconds": limit}
    meta["wall_seconds"] = sum(entry["seconds"] for entry in meta["steps"].values())
    atomic_write_json(out / "meta.json", meta)


def bench(out: Path, report: Path) -> None:
    merged = read(out / "bench.json", {"runs": []})
    merged["runs"].append(json.loads(report.read_text()))
    atomic_write_json(out / "bench.json", merged)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    first = commands.add_parser("start")
    first.add_argument("out", type=Path)
    first.add_argument("--device", required=True)
    first.add_argument("--tiny", action="store_true")
    each = commands.add_parser("step")
    each.add_argument("out", type=Path)
    each.add_argument("name")
    each.add_argument("rc", type=int)
    each.add_argument("seconds", type=float)
    each.add_argument("limit", type=float)
    each.add_argument("--note")
    merge = commands.add_parser("bench")
    merge.add_argument("out", type=Path)
    merge.add_argument("report", type=Path)
    args = parser.parse_args(argv)
    if args.command == "start":
        start(args.out, args.device, args.tiny)
    elif args.command == "step":
        step(args.out, args.name, args.rc, args.seconds, args.limit, args.note)
    else:
        bench(args.out, args.report)


if __name__ == "__main__":
    main()
