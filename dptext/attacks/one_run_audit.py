"""``one_run_audits``: the one-run audit of finished runs (`dptext mia --attack one-run`, SPEC §13).

The run was trained with ``audit.one_run_canaries = m``: m canary secrets, each included once, independently with
probability ½, by public coins drawn before training (``dptext.data.canaries.make_one_run_canaries``). Here every
canary is scored by its log-perplexity under the trained model (lower = more likely trained on), the auditor
guesses "in" for the k₊ lowest and "out" for the k₋ highest (both fixed before scoring: m/4 each by default) and
``dptext.attacks.one_run`` turns the v correct of r into an ε lower bound at the run's δ and the stated confidence,
reported next to the ε the accountant proved. The report goes to ``mia_not_private/one_run.json`` (not covered:
it names which canaries were trained on).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dptext.attacks.audit import proven_privacy
from dptext.attacks.audit_records import mia_folder, read_one_run
from dptext.attacks.canary_audit import _log_perplexities
from dptext.attacks.one_run import one_run_audit
from dptext.attacks.target import load_trained_run
from dptext.errors import UserError
from dptext.output import Output
from dptext.runs import RunDir, atomic_write_json, write_manifest

REPORT = "one_run.json"


def one_run_audit_of(run_dir: str | Path, k_plus: int | None = None, k_minus: int | None = None,
                     confidence: float = 0.95, batch_size: int = 32, output: Any = None) -> dict[str, Any]:
    """The one-run audit of one finished run (module docstring)."""
    output = output or Output(quiet=True)
    target = load_trained_run(run_dir)
    canaries = read_one_run(target.path)
    secrets = [c["secret"] for c in canaries["canaries"]]
    included = [bool(c["included"]) for c in canaries["canaries"]]
    m = len(secrets)
    k_plus = m // 4 if k_plus is None else k_plus
    k_minus = m // 4 if k_minus is None else k_minus
    bits = _log_perplexities(target, secrets, canaries["prefix"], batch_size, output, "scoring one-run canaries")
    privacy = proven_privacy(target)
    result = one_run_audit(-bits, included, privacy["delta"], k_plus, k_minus, confidence)
    report = {"run_dir": str(target.path), "recipe": target.recipe.name, "privacy": privacy,
              "k_plus": k_plus, "k_minus": k_minus, "included": int(sum(included)), **result.to_dict(),
              "exceeds_proven": privacy["epsilon"] is not None and result.epsilon > privacy["epsilon"]}
    atomic_write_json(mia_folder(target.path) / REPORT, report)
    write_manifest(target.path)
    return report


def one_run_audits(run_dirs: list[str | Path], **options: Any) -> list[dict[str, Any]]:
    if not run_dirs:
        raise UserError("Give at least one run directory to audit.")
    for run_dir in run_dirs:  # every run checked before the first is scored
        if RunDir.open(run_dir).load_result() is None:
            raise UserError(f"Run '{run_dir}' has not finished (no result.json); finish it with "
                            f"`dptext finetune --resume {run_dir}` before auditing it.")
        read_one_run(run_dir)
    return [one_run_audit_of(run_dir, **options) for run_dir in run_dirs]
