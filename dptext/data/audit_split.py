"""The audit split: the members / non-members / public pool and canaries chosen before training (SPEC §7).

Before training, ``split_for_audit`` permutes the training split with ``audit.seed`` and cuts it into
non-members (``holdout_fraction`` / ``holdout_examples``), a public pool (``public_examples``, for shadow and
reference models) and members (the rest), then appends the canaries. The run trains on members + canaries
only, so its n, q = B/n and δ = 1/(2n) are those of the data actually trained on.

The run directory then holds, written atomically::

    audit_not_private/README.md        says what follows: training records, not covered by ε
    audit_not_private/members.jsonl    {"index": i, "record": {...}} for every training record of the data split
    audit_not_private/nonmembers.jsonl the held-out records, same format
    audit_not_private/public.jsonl     the public pool, same format
    audit_not_private/canaries.json    prefix, vocabulary, secrets, repetition counts and canary unit
    audit_not_private/one_run.json     the one-run audit's canaries and which of them were trained on
    audit_not_private/split.json       sizes, seed and the n trained on

These files contain the training records themselves (every column, also those the task ignores, but not the
``"user"`` a user column adds: a user id is never written to any output), so the
folder's name, its README and the run's ``release.json`` mark it not covered by ε; ``dptext mia`` writes its
reports and reference runs to ``mia_not_private/`` for the same reason. Model exports (``model/``) never
include either. ``dptext.attacks.audit_records`` reads these files back; attacks never write them.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dptext.data.canaries import canary_record, canary_user, make_canaries, make_one_run_canaries
from dptext.data.users import USER
from dptext.errors import UserError
from dptext.runs import atomic_directory

AUDIT_DIR = "audit_not_private"
README = "README.md"
NOT_PRIVATE_README = """# {title}: NOT covered by differential privacy

{body}

Nothing in this folder is protected by the run's (ε, δ): keep it with the private data and never publish or
ship it. The trained model is in `../model/`; `../release.json` lists what ε covers.
"""
AUDIT_README = NOT_PRIVATE_README.format(title="Audit split", body=(
    "These files hold copies of the training records themselves (members, held-out non-members, the public pool, "
    "every column of each record, also those the task ignores) and the canaries' secrets, for `dptext mia`."))
FILES = {"members": "members.jsonl", "nonmembers": "nonmembers.jsonl", "public": "public.jsonl"}
CANARIES = "canaries.json"
ONE_RUN = "one_run.json"
SPLIT = "split.json"


@dataclass
class AuditSplit:
    members: list = field(default_factory=list)  # (index in the training split, record)
    nonmembers: list = field(default_factory=list)
    public: list = field(default_factory=list)
    canaries: dict | None = None
    one_run: dict | None = None  # the one-run audit's canaries with their inclusion bits
    seed: int = 0

    def training_records(self, task_type: str, control_codes: list) -> list[dict[str, Any]]:
        """Members, then every copy of every canary; where the members carry users (data.user_column) each copy
        gets its synthetic user (``canary_user``), so user-level training can bound the canary like any user."""
        records = [record for _, record in self.members]
        real_users = {record[USER] for record in records if USER in record}
        canaries = (self.canaries or {}).get("canaries", [])
        for number, canary in enumerate(canaries):
            record = canary_record(task_type, self.canaries["prefix"], canary["secret"], control_codes)
            copies = [dict(record) for _ in range(canary["repetitions"])]
            for copy, planted in enumerate(copies if real_users else []):
                planted[USER] = canary_user(self.seed, number, self.canaries.get("unit", "example"), copy)
                if planted[USER] in real_users:  # a real user merged with a canary would blur what is measured
                    raise UserError("A user of the training data has the id of a synthetic canary user; change "
                                    "audit.seed so the canaries get other ids.")
            records += copies
        one_run = (self.one_run or {}).get("canaries", [])
        for number, canary in enumerate(c for c in one_run if c["included"]):  # once each: k = 1 per canary
            record = canary_record(task_type, self.one_run["prefix"], canary["secret"], control_codes)
            if real_users:
                record[USER] = canary_user(self.seed, f"one-run-{number}", "example", 0)
            records.append(record)
        return records


def audit_requested(audit: Any) -> bool:
    return bool(audit.holdout_fraction or audit.holdout_examples or audit.public_examples or audit.canaries
                or audit.train_indices or audit.one_run_canaries)


def trained_size(audit: Any, split_size: int) -> int:
    """n that a run with this ``audit`` section trains on, from the size of its training split (for accounting
    that has no data at hand, e.g. `dptext account --eps` over recipes): members plus every canary copy."""
    if audit.train_indices:
        return len(set(audit.train_indices))
    held = audit.holdout_examples if audit.holdout_examples is not None else int(round(audit.holdout_fraction
                                                                                      * split_size))
    one_run = sum(c["included"] for c in make_one_run_canaries(audit)["canaries"]) if audit.one_run_canaries else 0
    return (split_size - held - audit.public_examples + one_run
            + audit.canaries * sum(int(r) for r in audit.canary_repetitions))


def split_for_audit(recipe: Any, train: list[dict[str, Any]]) -> AuditSplit:
    """The seeded partition of ``train`` that ``recipe.audit`` asks for (see the module docs)."""
    audit = recipe.audit
    n = len(train)
    if audit.train_indices:
        bad = [i for i in audit.train_indices if not isinstance(i, int) or not 0 <= i < n]
        if bad:
            raise UserError(f"audit.train_indices has {len(bad)} entries outside the training split of {n} records; "
                            "they must be indices of the same data.")
        chosen = set(audit.train_indices)
        return AuditSplit(members=[(i, train[i]) for i in sorted(chosen)], seed=audit.seed)
    if not 0 <= audit.holdout_fraction < 1:
        raise UserError(f"audit.holdout_fraction={audit.holdout_fraction} must lie in [0, 1).")
    held = audit.holdout_examples if audit.holdout_examples is not None else int(round(audit.holdout_fraction * n))
    if held < 0 or audit.public_examples < 0 or held + audit.public_examples >= n:
        raise UserError(f"audit holds out {held} non-members and {audit.public_examples} public records from a "
                        f"training split of {n}; leave some to train on (raise data.max_train_examples).")
    order = list(range(n))
    random.Random(f"audit-split-{audit.seed}").shuffle(order)
    cut = held + audit.public_examples
    split = AuditSplit(nonmembers=[(i, train[i]) for i in sorted(order[:held])],
                       public=[(i, train[i]) for i in sorted(order[held:cut])],
                       members=[(i, train[i]) for i in sorted(order[cut:])], seed=audit.seed)
    if audit.canaries:
        canary_record(recipe.task.type, "", "")  # refuses classification before anything is drawn
        split.canaries = make_canaries(audit)
    if audit.one_run_canaries:
        canary_record(recipe.task.type, "", "")  # refuses classification before anything is drawn
        split.one_run = make_one_run_canaries(audit)
    return split


def _jsonl(rows: list) -> str:
    return "".join(json.dumps({"index": i, "record": {k: v for k, v in r.items() if k != USER}}, ensure_ascii=False)
                   + "\n" for i, r in rows)


def write_audit(run_path: str | Path, split: AuditSplit, trained_on: int) -> Path:
    """Write the audit folder in one atomic rename (a reader sees all of it or none)."""
    target = Path(run_path) / AUDIT_DIR
    with atomic_directory(target) as staging:
        (staging / README).write_text(AUDIT_README, encoding="utf-8")
        for name, filename in FILES.items():
            (staging / filename).write_text(_jsonl(getattr(split, name)), encoding="utf-8")
        if split.canaries is not None:
            (staging / CANARIES).write_text(json.dumps(split.canaries, indent=2), encoding="utf-8")
        if split.one_run is not None:
            (staging / ONE_RUN).write_text(json.dumps(split.one_run, indent=2), encoding="utf-8")
        sizes = {name: len(getattr(split, name)) for name in FILES}
        (staging / SPLIT).write_text(json.dumps({**sizes, "seed": split.seed, "trained_on": trained_on}, indent=2),
                                     encoding="utf-8")
    return target

