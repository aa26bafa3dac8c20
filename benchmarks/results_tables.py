"""The results tables of docs/results.md, generated from benchmarks/results/*.json (never typed by hand).

``render(results)`` is the Markdown between the results markers of docs/results.md; ``rewrite_readme`` puts it
there. tests/test_results_tables.py checks that the docs/results.md block is what the files say. An entry a
file does not have yet is "running"; the published numbers beside ours are the papers' (cited).
"""

from __future__ import annotations

import re
from pathlib import Path

BEGIN, END = "<!-- results:begin (benchmarks/collect_results.py) -->", "<!-- results:end -->"
RUNNING = "running"

# Li et al. 2022, Table 1 (RoBERTa-base, SST-2 dev accuracy): full fine-tuning with a head, and with infilling
LI_SST2 = {"eps8": ("85.89", "92.09"), "eps3": ("86.12", "91.86"), "nonprivate": ("—", "—")}
# Dupuy et al. 2022, Table 1 (ATIS SER, non-private): BERT 5.4, CLC 6.3
DUPUY_ATIS = {"nonprivate": "5.4 (BERT), 6.3 (CLC)"}
# Li et al. 2022 (GPT-2 small, full E2E training set, full fine-tuning), SPEC §9
LI_E2E = {"nonprivate": "69.5", "eps8": "63.2"}
LABELS = {"nonprivate": "non-private", "eps8": "ε = 8", "eps3": "ε = 3", "dp_sgd_eps8": "DP-SGD, ε = 8",
          "edp_eps8": "eDP-SGD, ε = 8"}


def number(value, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _row(cells: list) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(header: list[str], rows: list[list]) -> list[str]:
    return [_row(header), "|" + "---|" * len(header), *(_row(r) for r in rows)]


def _privacy(entry: dict) -> list[str]:
    if not entry["private"]:
        return ["∞ (none)", "—"]
    return [number(entry["epsilon_rdp"]), number(entry["epsilon_pld"])]


def _hours(entry: dict) -> str:
    """Wall hours; a run on a GPU says so beside its time (minutes there are hours on the 2-core CPU)."""
    if entry["wall_seconds"] is None:
        return "—"
    gpu = re.search(r"NVIDIA (\S+)", entry.get("machine", ""))
    hours = entry["wall_seconds"] / 3600
    return f"{hours:.2f} on {gpu.group(1)}" if gpu else number(hours, 1)


def _learning_rate(entry: dict) -> str:
    """The rate used and, for a searched one, the rates it was chosen from."""
    searched = entry.get("search", {}).get("candidates")
    chosen_from = " (of " + ", ".join(f"{c['learning_rate']:g}" for c in searched) + ")" if searched else ""
    return f"{entry['learning_rate']:g}{chosen_from}"


def sst2(data: dict) -> list[str]:
    rows = []
    for key in ("nonprivate", "eps8", "eps3"):
        head, infill = LI_SST2[key]
        e = data.get(key)
        ours = [RUNNING] * 6 if e is None else [number(e["accuracy"]), *_privacy(e), e["steps"], _hours(e),
                                                _learning_rate(e)]
        rows.append([LABELS[key], *ours, head, infill])
    lines = _table(["SST-2 (MiniLM-L6, full, head)", "dev accuracy", "ε (RDP)", "ε (PLD)", "steps", "hours",
                    "lr (DP: searched on a training-set holdout)", "Li et al. full + head",
                    "Li et al. full + infilling"], rows)
    if "nonprivate" in data and "eps8" in data:
        gap = data["nonprivate"]["accuracy"] - data["eps8"]["accuracy"]
        lines.append("")
        lines.append(f"DP gap at ε = 8: {gap:.2f} points (target ≤ 4: {'met' if gap <= 4 else 'missed'}).")
    return lines


def nlu(name: str, data: dict) -> list[str]:
    base = data.get("nonprivate", {}).get("seconds_per_epoch")
    rows = []
    for key in ("nonprivate", "dp_sgd_eps8", "edp_eps8"):
        e = data.get(key)
        if e is None:
            rows.append([LABELS[key], *[RUNNING] * 8])
            continue
        ratio = number(e["seconds_per_epoch"] / base) if base and e["seconds_per_epoch"] else "—"
        rows.append([LABELS[key], number(e["ser"]), number(e["intent_accuracy"]), number(e["slot_f1"]),
                     *_privacy(e), number(e["seconds_per_epoch"], 0), ratio, _learning_rate(e)])
    lines = _table([f"{name.upper()} (MiniLM-L6, full), test", "SER", "intent acc.", "slot F1", "ε (RDP)", "ε (PLD)",
                    "s / epoch", "epoch time ÷ non-private", "lr (searched on validation)"], rows)
    if name == "atis":
        lines += ["", f"Dupuy et al. (non-private SER): {DUPUY_ATIS['nonprivate']}; target here ≤ 10."]
    return lines


QUICKSTART_ROWS = {"eps8": "ε = 8 (the recipe)", "nonprivate": "non-private, the recipe's lr",
                   "nonprivate_lr5e-4": "non-private, lr 5e-4", "nonprivate_lr1e-4": "non-private, lr 1e-4"}


def quickstart(data: dict) -> list[str]:
    rows = []
    for key, label in QUICKSTART_ROWS.items():
        e = data.get(key)
        ours = [RUNNING] * 4 if e is None else [number(e["accuracy"]), *_privacy(e), _learning_rate(e)]
        rows.append([label, *ours])
    return _table(["Quickstart (IMDB, MiniLM-L6 top 2), validation", "accuracy", "ε (RDP)", "ε (PLD)", "lr"], rows)


def e2e(data: dict) -> list[str]:
    rows = []
    for key in ("nonprivate", "eps8"):
        e = data.get(key)
        ours = [RUNNING] * 5 if e is None else [number(e["bleu"]), number(e["rouge_l"]), *_privacy(e), _hours(e)]
        rows.append([LABELS[key], *ours, LI_E2E[key]])
    return _table(["E2E at CPU scale (SmolLM2-135M, subset)", "BLEU", "ROUGE-L", "ε (RDP)", "ε (PLD)", "hours",
                   "Li et al. BLEU (GPT-2, full E2E)"], rows)


# DistilDP's rows, in order (benchmarks/collect_distill.py maps each to its run folder)
DISTILL_ROWS = {
    "pretrained": "SmolLM2-135M, no training (reference)",
    "teacher_eps2": "teacher, DP-SGD",
    "zero_shot": "zero-shot student",
    "dp_sgd": "DP-SGD student (whole ε on real data)",
    "teacher_eps1": "DPKD teacher, DP-SGD at half the budget",
    "dpkd": "DPKD: DP-SGD student on the KD loss with the rest",
    "synthetic_only": "DP synthetic data only (λ = 0)",
    "distildp": "**DistilDP** (λ = 0.4, t = 1)",
}


def _significant(value, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}g}"


def distill(data: dict) -> list[str]:
    rows = []
    for key, label in DISTILL_ROWS.items():
        e = data.get(key)
        ours = [RUNNING] * 6 if e is None else [
            e["model"], _significant(e["epsilon"]), _significant(e["delta"], 2) if e["delta"] else "0",
            _significant(e["test_perplexity"], 4), e["steps"] or "—", _hours(e)]
        rows.append([label, *ours])
    return _table(["DistilDP (Amazon reviews, SmolLM2-135M, 4,000 reviews)", "model", "ε", "δ", "test PPL", "steps",
                   "hours"], rows)


# the result files this block renders (others, such as the bench grid's, have their own block)
TABLES = ("sst2", "atis", "snips", "quickstart", "e2e_cpu", "distill")


def render(results: dict[str, dict]) -> str:
    results = {name: data for name, data in results.items() if name in TABLES}
    parts = [sst2(results.get("sst2", {})), nlu("atis", results.get("atis", {})),
             nlu("snips", results.get("snips", {})), quickstart(results.get("quickstart", {})),
             e2e(results.get("e2e_cpu", {})), distill(results.get("distill", {}))]
    entries = [e for data in results.values() for e in data.values()]
    commits = sorted({e["commit"] for e in entries if "commit" in e})  # the synthetic data's entry has neither
    machines = sorted({e["machine"] for e in entries if "machine" in e})
    footer = [f"Code: {', '.join(commits) or '—'}. Machine: {'; '.join(machines) or '—'}."]
    return "\n\n".join("\n".join(p) for p in [*parts, footer])


def rewrite_readme(readme: Path, results: dict[str, dict]) -> None:
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme} has no results block; add the lines {BEGIN!r} and {END!r} where it goes.")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{render(results)}\n{END}{tail}")


def readme_block(readme: Path) -> str:
    text = readme.read_text()
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")
