"""Print a Markdown table of finished runs (result.json) side by side, e.g. the E2E reproduction.

    python benchmarks/collect_runs.py runs/e2e-smollm-*
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dptext.runs import RunDir  # noqa: E402  (after the path: runs from a checkout without installing)


def row(run_dir: Path) -> list[str]:
    result = json.loads((run_dir / "result.json").read_text())
    privacy = result["privacy"]
    if privacy["private"]:
        eps = privacy["epsilon"]
        budget = (f"ε={eps['rdp']['epsilon']:.2f} (RDP), δ={privacy['delta']:.2g}, "
                  f"σ={privacy['noise_multiplier']:.3f}")
    else:
        budget = "non-private"
    metrics = result["metrics"]
    cells = [f"{metrics[name]:.2f}" if name in metrics else "-"
             for name in ("bleu", "rouge_l", "perplexity", "accuracy")]
    return [result["recipe"], budget, *cells, str(privacy["steps"]), _minutes(RunDir(run_dir).finished_seconds())]


def _minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60:.1f}"


def main(paths: list[str]) -> None:
    header = ["run", "privacy", "BLEU", "ROUGE-L", "perplexity", "accuracy", "steps", "minutes"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for path in paths:
        run_dir = Path(path)
        if (run_dir / "result.json").exists():
            print("| " + " | ".join(row(run_dir)) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
