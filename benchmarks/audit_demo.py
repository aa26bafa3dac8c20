"""The privacy-auditing demonstration of docs/auditing.md (`make audit-demo`).

Builds a small byte-level GPT-2 from scratch (a saved folder; SmolLM2-135M is too slow to train six times on a
shared 2-core CPU), fine-tunes recipes/audit-e2e.yaml non-privately and at ε = 8 and ε = 1 (each with the
member / non-member / public split and canaries the recipe asks for), trains each run's reference models and
audits all runs side by side (reference models, for shadow and LiRA, only for ``--shadow-variants``: each
costs as much as its target):

    dptext mia NONPRIVATE EPS8 EPS1                   -> mia.json, roc.png (loss attack)
    dptext mia NONPRIVATE --attack all                -> mia-all.json, roc-all.png (shadow, LiRA)
    dptext mia canary NONPRIVATE EPS8 EPS1            -> canary.json

Runs are independent chains (target, then its references) executed ``--jobs`` at a time, each with one BLAS
thread (on a busy 2-core machine, oversubscribed threads cost far more than they give). Results go to
``--out`` (default runs/audit-demo); a rerun reuses finished runs and references.

    python benchmarks/audit_demo.py [--out DIR] [--jobs 2] [--references 2] [--shadow-variants nonprivate]
                                    [--members 200] [--epochs 60] [--hidden 96 --layers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DPTEXT = [sys.executable, "-m", "dptext"]
VARIANTS = {"nonprivate": ["privacy.enabled=false"], "eps8": ["privacy.target_epsilon=8"],
            "eps1": ["privacy.target_epsilon=1"]}


def build_model(folder: Path, hidden: int, layers: int) -> None:
    """GPT-2 with ``hidden`` width and ``layers`` blocks over the tiny models' byte-level vocabulary, seed 0."""
    if (folder / "config.json").is_file():
        return
    import torch
    from transformers import AutoModelForCausalLM

    from dptext.models import tiny_config, tiny_tokenizer
    from dptext.runs import atomic_directory

    tokenizer = tiny_tokenizer("tiny-gpt2")
    config = tiny_config("tiny-gpt2", len(tokenizer), n_embd=hidden, n_layer=layers, n_head=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with atomic_directory(folder) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)


def run(command: list[str], log: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with open(log, "a") as handle:
        handle.write(f"$ {' '.join(command)}\n")
        handle.flush()
        subprocess.run(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, check=True)


def chain(name: str, args: argparse.Namespace, model: Path) -> float:
    """Fine-tune one variant (unless finished) and train its reference models; returns seconds."""
    started = time.monotonic()
    target = args.out / name
    log = args.out / f"{name}.log"
    if not (target / "result.json").is_file():
        resume = ["--resume", str(target)] if (target / "resolved.yaml").is_file() else [
            "recipes/audit-e2e.yaml", f"data.path={args.data}", f"model.name={model}", f"name=audit-e2e-{name}",
            f"train.epochs={args.epochs}", f"audit.holdout_examples={args.members}",
            f"audit.public_examples={2 * args.members}", f"data.max_train_examples={4 * args.members}",
            *VARIANTS[name], "--out", str(target)]
        run([*DPTEXT, "finetune", *resume], log)
    if args.references and name in args.shadow_variants.split(","):
        run([*DPTEXT, "mia", str(target), "--attack", "all", "--references", str(args.references)], log)
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/audit-demo"))
    parser.add_argument("--data", default="../shared/data/e2e_nlg")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--references", type=int, default=2)
    parser.add_argument("--epochs", type=float, default=60)
    parser.add_argument("--hidden", type=int, default=96)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--candidates", type=int, default=2000)
    parser.add_argument("--variants", default="nonprivate,eps8,eps1")
    parser.add_argument("--shadow-variants", default="nonprivate",
                        help="variants that also get reference models (shadow and LiRA attacks)")
    parser.add_argument("--members", type=int, default=200, help="audit.holdout_examples and members alike")
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    model = args.out / f"gpt2-bytes-h{args.hidden}-l{args.layers}"
    build_model(model, args.hidden, args.layers)
    names = args.variants.split(",")
    with ThreadPoolExecutor(args.jobs) as pool:
        seconds = dict(zip(names, pool.map(lambda n: chain(n, args, model), names)))
    targets = [str(args.out / n) for n in names]
    shadowed = [str(args.out / n) for n in names if args.references and n in args.shadow_variants.split(",")]
    log = args.out / "audit.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    commands = {"mia": [*DPTEXT, "mia", *targets, "--plot", str(args.out / "roc.png"), "--json"],
                "canary": [*DPTEXT, "mia", "canary", *targets, "--candidates", str(args.candidates), "--json"]}
    if shadowed:
        commands["mia-all"] = [*DPTEXT, "mia", *shadowed, "--attack", "all", "--references", str(args.references),
                               "--plot", str(args.out / "roc-all.png"), "--json"]
    for kind, command in commands.items():
        with open(log, "a") as handle:
            result = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=handle, check=True)
        (args.out / f"{kind}.json").write_bytes(result.stdout)
    mia, canary = (json.loads((args.out / f"{k}.json").read_text()) for k in ("mia", "canary"))
    if shadowed:  # the shadow and LiRA rows of the runs that have reference models
        extra = json.loads((args.out / "mia-all.json").read_text())["runs"]
        for report in mia["runs"]:
            for other in extra:
                if other["run_dir"] == report["run_dir"]:
                    report["attacks"] = other["attacks"]
    print(f"model: {model.name} ({args.hidden} hidden, {args.layers} layers); chains: "
          + ", ".join(f"{n} {s / 60:.1f} min" for n, s in seconds.items())
          + f"; total {(time.monotonic() - started) / 60:.1f} min")
    print("| run | attack | AUC | TPR@1%FPR | TPR@0.1%FPR | ε lower bound (95%) | ε proven |")
    print("|---|---|---|---|---|---|---|")
    for report in mia["runs"]:
        label = f"ε = {report['privacy']['epsilon']:.3g}" if report["privacy"]["private"] else "non-private"
        proven = f"{report['privacy']['epsilon']:.3g}" if report["privacy"]["private"] else "none"
        for attack, s in report["attacks"].items():
            print(f"| {label} | {attack} | {s['auc']:.3f} | {s['tpr_at_fpr_0.01']:.3f} | {s['tpr_at_fpr_0.001']:.3f} "
                  f"| {s['epsilon_lower_bound']['epsilon']:.2f} | {proven} |")
    print("| run | repetitions | exposure (sampled rank), mean | exposure (skew-normal fit), mean [min, max] |")
    print("|---|---|---|---|")
    for report in canary["runs"]:
        label = f"ε = {report['privacy']['epsilon']:.3g}" if report["privacy"]["private"] else "non-private"
        for g in report["by_repetitions"]:
            print(f"| {label} | {g['repetitions']} | {g['exposure_sampled_mean']:.1f} | "
                  f"{g['exposure_fitted_mean']:.1f} [{g['exposure_fitted_min']:.1f}, {g['exposure_fitted_max']:.1f}] |")
    print(f"log2|R| = {canary['runs'][0]['log2_space_size']:.1f}, {canary['runs'][0]['candidates']} candidates")


if __name__ == "__main__":
    main()
