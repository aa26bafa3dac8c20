"""The user-level DP demonstration (issue 24): Amazon reviews at user-level ε = 8, example-level ε = 8, non-private.

    nohup python benchmarks/user_level.py run >/dev/null 2>&1 &   # the three runs, one after another, resumably
    python benchmarks/user_level.py collect                      # results/user_level.json + docs/results.md block
    python benchmarks/user_level.py readme                       # the docs/results.md block from the JSON file only

``run`` is ``results_queue.py`` on JOBS (each run under ``nice -n 19``; a started run continues with
``--resume``, a finished one is skipped; restart it at any time). ``collect`` reads the finished run folders
(RUNS/user-level/<setting>) and writes one row per setting: accuracy on the test split, ε (RDP, and PLD from
the ledger), δ, the privacy unit, the number of users and k, the training examples, wall time, machine and
commit. Users and examples are counted from the data with the run's own resolved recipe (counts only; no
user id is read into this file). A setting that has not finished shows as "running", never as a number.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "user_level.json"
README = ROOT / "docs" / "results.md"  # the page holding the generated tables
BEGIN, END = "<!-- user-level:begin (benchmarks/user_level.py) -->", "<!-- user-level:end -->"
AMAZON = "data.path={data}/amazon_multidomain_sentiment"
CHECKPOINTS = "train.checkpoint_every=10"  # a stopped machine loses at most 10 steps (the queue resumes)
# setting: (job name = run folder under RUNS, recipe, overrides)
JOBS = {
    "user-level ε = 8": ("user-level/user", "recipes/amazon-user-level.yaml", [AMAZON, CHECKPOINTS]),
    "example-level ε = 8": ("user-level/example", "recipes/amazon-example-level.yaml", [AMAZON, CHECKPOINTS]),
    "non-private": ("user-level/nonprivate", "recipes/amazon-example-level.yaml",
                    [AMAZON, CHECKPOINTS, "privacy.enabled=false", "name=amazon-nonprivate"]),
}


def job_file(folder: Path) -> Path:
    """JOBS in results_queue.py's job-file format (NAME RECIPE key=value ...)."""
    path = folder / "user_level_jobs.txt"
    path.write_text("".join(f"{name} {recipe} {' '.join(overrides)}\n" for name, recipe, overrides in JOBS.values()))
    return path


def counts(run_dir: Path) -> dict:
    """Users, k and examples of the run's training split, counted from the data with its resolved recipe."""
    from dptext.data import load_records
    from dptext.data.users import user_groups
    from dptext.runs import RunDir

    recipe = RunDir.open(run_dir).recipe()
    records = load_records(recipe.data, "train")
    # privacy.unit / max_examples_per_user: issue 24's recipe keys (recipes before it are example-level)
    unit = recipe.privacy.unit if recipe.privacy.enabled else "none"
    row = {"unit": unit, "examples": len(records), "users": None, "k": None, "examples_within_k": None}
    if unit == "user":
        groups, k = user_groups(records), recipe.privacy.max_examples_per_user
        row.update(users=len(groups), k=k, examples_within_k=sum(min(len(g), k) for g in groups))
    return row


def collect(runs: Path) -> dict:
    from collect_results import entry  # the sibling script: one reading of result.json, ledger and provenance

    rows = {}
    for setting, (name, _, _) in JOBS.items():
        run_dir = runs / name
        if (run_dir / "result.json").is_file():
            row = entry(run_dir, {"accuracy": "accuracy"})
            rows[setting] = {"setting": setting, **counts(run_dir), **row}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=2, ensure_ascii=False) + "\n")
    return rows


def number(value, digits: int = 2) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def delta(value) -> str:
    return "—" if value is None else f"{value:.2g}"


def render(rows: dict) -> str:
    lines = ["| setting | accuracy (test, %) | ε (RDP) | ε (PLD) | δ | unit | users | k | training examples | "
             "wall time (h) |", "|" + "---|" * 10]
    for setting in JOBS:
        row = rows.get(setting)
        if row is None:
            lines.append(f"| {setting} | running | | | | | | | | |")
            continue
        users = "—" if row["users"] is None else f"{row['users']:,}"
        lines.append(f"| {setting} | {number(row['accuracy'])} | {number(row['epsilon_rdp'])} | "
                     f"{number(row['epsilon_pld'])} | {delta(row.get('delta'))} | {row['unit']} | {users} | "
                     f"{row['k'] or '—'} | {row['examples']:,} | {number(row['wall_seconds'] / 3600)} |")
    machines = sorted({r["machine"] for r in rows.values()})
    commits = sorted({r["commit"] for r in rows.values()})
    lines += ["", f"Code: {', '.join(commits) or '—'}. Machine: {'; '.join(machines) or '—'}."]
    return "\n".join(lines)


def rewrite_readme(rows: dict) -> None:
    text = README.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{README} has no user-level block; add the lines {BEGIN!r} and {END!r} where it goes.")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    README.write_text(f"{head}{BEGIN}\n{render(rows)}\n{END}{tail}")


def load() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("run", "collect", "readme"))
    parser.add_argument("--runs", type=Path, default=Path("/work/results-runs"), help="folder of the run folders")
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data", help="the shared data folder")
    args = parser.parse_args(argv)
    if args.command == "run":
        import results_queue

        with tempfile.TemporaryDirectory() as folder:
            return results_queue.main([str(job_file(Path(folder))), "--runs", str(args.runs), "--data",
                                       str(args.data), "--wait"])
    rows = collect(args.runs) if args.command == "collect" else load()
    rewrite_readme(rows)
    print(f"{RESULTS}: {', '.join(rows) or 'nothing finished yet'}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))  # the sibling scripts; benchmarks/ is not a package
    sys.path.insert(0, str(ROOT))  # the dptext of this checkout
    sys.exit(main())
