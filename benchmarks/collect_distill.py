"""The DistilDP comparison table from the run directories `benchmarks/distill_offline.sh` writes.

Usage: python benchmarks/collect_distill.py RUNS_DIR [--json]
Rows: the teacher(s), then each student method; PPL is on the real test split (text only, code as the prompt).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dptext.runs import RunDir  # noqa: E402  (after the path: runs from a checkout without installing)

ROWS = [("pretrained", "pretrained teacher model, no training"), ("teacher-eps2", "teacher (DP-SGD)"),
        ("teacher-eps1", "DPKD teacher (DP-SGD)"),
        ("zero_shot", "zero-shot student"), ("dp_sgd", "DP-SGD student"), ("dpkd", "DPKD student"),
        ("synthetic_only", "DP synthetic data only (λ=0)"), ("distildp", "DistilDP (λ=0.4, t=1)")]


def row(run: Path, label: str) -> dict | None:
    path = run / "result.json"
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    claim = result.get("privacy_claim")
    if claim is None:  # a teacher: its own DP-SGD run
        privacy = result["privacy"]
        claim = {"epsilon": privacy["epsilon"][privacy["accountant"]]["epsilon"], "delta": privacy["delta"]}
    student = result.get("student")
    model = (f"{student['source']} {len(student['layers'])}/{student['source_layers']} layers "
             f"({student['parameters'] / 1e6:.1f}M)") if student else result["model"]
    return {"run": run.name, "method": label, "model": model, "epsilon": claim["epsilon"], "delta": claim["delta"],
            "test_perplexity": result["metrics"].get("perplexity"), "seconds": RunDir(run).finished_seconds(),
            "steps": result.get("privacy", {}).get("steps")}


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path("runs/distill-offline")
    rows = [r for name, label in ROWS if (r := row(root / name, label)) is not None]
    if "--json" in argv:
        print(json.dumps(rows, indent=2))
        return 0
    print("| method | model | ε | δ | test PPL | steps | time (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        eps = f"{r['epsilon']:.3g}" if r["epsilon"] is not None else "—"
        delta = f"{r['delta']:.2g}" if r["delta"] else "0"
        ppl = f"{r['test_perplexity']:.4g}" if r["test_perplexity"] is not None else "—"
        seconds = f"{r['seconds']:.0f}" if r["seconds"] is not None else "—"
        print(f"| {r['method']} | {r['model']} | {eps} | {delta} | {ppl} | {r['steps'] or '—'} | {seconds} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
