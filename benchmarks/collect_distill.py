"""The DistilDP comparison from the run directories of one chain (benchmarks/jobs.txt's ``distill-long/``, or
what `benchmarks/distill_offline.sh` writes).

Usage: python benchmarks/collect_distill.py RUNS_DIR [--json]      (prints the table, or the entries as JSON)

`benchmarks/collect_results.py collect` writes the same entries of ``RUNS/distill-long`` into
``benchmarks/results/distill.json``, from which the table of docs/results.md is generated.
Rows: the pretrained model, the
teacher(s), then each student; PPL is on the real test split (text only, code as the prompt). An entry is written
only from a finished run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))

from collect_results import arithmetic, epsilon_pld, machine_and_commit, read_json, timing, wall_seconds  # noqa: E402
from dptext.accounting.carried import guaranteed_epsilon  # noqa: E402  (collect_results put the checkout on the path)
from dptext.runs import DIAGNOSTICS, RunDir  # noqa: E402  (collect_results put the checkout on the path)
from results_tables import DISTILL_ROWS  # noqa: E402

# entry key -> run folder inside the chain's folder (the rows, in the table's order, are results_tables.DISTILL_ROWS)
FOLDERS = {"pretrained": "pretrained", "teacher_eps2": "teacher-eps2", "zero_shot": "zero_shot", "dp_sgd": "dp_sgd",
           "teacher_eps1": "teacher-eps1", "dpkd": "dpkd", "synthetic_only": "synthetic_only", "distildp": "distildp"}
SYNTHETIC = "synthetic"  # the teacher's synthetic data (not a row: the students' training set)


def entry(run: Path, label: str) -> dict | None:
    """One row: test perplexity, the (ε, δ) the model carries, its size, steps and time; None while unfinished."""
    if not (run / "result.json").is_file():
        return None
    result = read_json(run / "result.json")
    claim = result.get("privacy_claim")
    privacy = result.get("privacy", {})
    if claim is None:  # a teacher: its own DP-SGD run, at its accountant's upper bound
        claim = {"epsilon": guaranteed_epsilon(privacy)[1], "delta": privacy["delta"], "composition": "one DP-SGD run"}
    student = result.get("student")
    model = (f"{student['source']} {len(student['layers'])}/{student['source_layers']} layers "
             f"({student['parameters'] / 1e6:.1f}M)") if student else result["model"]
    directory = RunDir(run)
    records = directory.read_metrics(DIAGNOSTICS) + directory.read_metrics()
    clock = timing(records, 1.0 / privacy["sample_rate"]) if privacy.get("sample_rate") else {}
    ledger = run / "ledger.json"
    dp_sgd_ledger = read_json(ledger) if ledger.is_file() else {}
    out = {"run": run.name, "method": label, "model": model, "test_perplexity": result["metrics"].get("perplexity"),
           "epsilon": claim["epsilon"], "delta": claim["delta"], "composition": claim.get("composition"),
           # the tight ε of the run's own DP-SGD steps (teachers and DP-SGD students); a DPKD student's is its share
           "epsilon_pld_own_steps": epsilon_pld(dp_sgd_ledger) if dp_sgd_ledger.get("runs") else None,
           "steps": result.get("steps_run", privacy.get("steps")), "noise_multiplier": privacy.get("noise_multiplier"),
           "expected_batch_size": privacy.get("expected_batch_size"), "dataset_size": privacy.get("dataset_size"),
           "train_seconds": clock.get("train_seconds"), "wall_seconds": wall_seconds(directory, records, clock)}
    if (run / "provenance.json").is_file():
        provenance = read_json(run / "provenance.json")
        out.update(machine_and_commit(provenance))
        if (run / "resolved.yaml").is_file():
            out["precision"] = arithmetic((run / "resolved.yaml").read_text(), provenance)
    return out


def synthetic_entry(folder: Path) -> dict | None:
    """What the students trained on: size, ε of the data (teacher + code histogram), coverage. Not the count of
    training texts copied verbatim (``training_copies_not_private.json``): it is computed from the private training
    texts without noise, and a committed result file is published (docs/finetuning.md, "What a run writes")."""
    if not (folder / "provenance.json").is_file():
        return None
    if not (folder / "release.json").is_file():
        raise SystemExit(f"{folder} has no release.json, so what may be published from it is unknown; re-run synth "
                         "with this dptext (it writes one) before collecting.")
    status = {f["path"]: f["status"] for f in read_json(folder / "release.json")["files"]}
    # fail closed: a file the registry does not list as covered or public (absent included) is not published
    hidden = [name for name in ("provenance.json", "summary.json") if status.get(name) not in ("covered", "public")]
    if hidden:  # e.g. synth --codes exact: the code histogram is the private data's own
        raise SystemExit(f"{folder}: {', '.join(hidden)} not covered by ε or public (release.json), so not collected "
                         "into a published result; re-run synth without the flag that took it out of the guarantee.")
    provenance, summary = read_json(folder / "provenance.json"), read_json(folder / "summary.json")
    return {"run": folder.name, "n": summary["n"], "splits": summary["splits"], "privacy": provenance["privacy"],
            "code_distribution": provenance["code_distribution"], "generation": provenance["generation"],
            "code_coverage": {k: v for k, v in summary["code_coverage"].items() if k != "per_code"},
            "length_tokens": summary["length_tokens"], "exact_duplicate_rate": summary["exact_duplicate_rate"],
            "throughput": summary.get("throughput_this_session")}


def collect(root: Path) -> dict[str, dict]:
    """Every finished row of the chain in ``root`` (and its synthetic data), keyed as in DISTILL_ROWS."""
    found = {key: row for key, label in DISTILL_ROWS.items() if (row := entry(root / FOLDERS[key], label)) is not None}
    if (synthetic := synthetic_entry(root / SYNTHETIC)) is not None:
        found[SYNTHETIC] = synthetic
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path("runs/distill-offline")
    rows = collect(root)
    if "--json" in argv:
        print(json.dumps(rows, indent=2))
        return 0
    print("| method | model | ε | δ | test PPL | steps | time (s) |")
    print("|---|---|---|---|---|---|---|")
    for key in DISTILL_ROWS:
        if (r := rows.get(key)) is None:
            continue
        eps = f"{r['epsilon']:.3g}" if r["epsilon"] is not None else "—"
        delta = f"{r['delta']:.2g}" if r["delta"] else "0"
        ppl = f"{r['test_perplexity']:.4g}" if r["test_perplexity"] is not None else "—"
        seconds = f"{r['wall_seconds']:.0f}" if r["wall_seconds"] is not None else "—"
        print(f"| {r['method']} | {r['model']} | {eps} | {delta} | {ppl} | {r['steps'] or '—'} | {seconds} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
