"""Split names and the seeded train/validation/test partition for sources without one.

The partition must be identical across runs, machines and Python versions, and must not
move an example to another split when unrelated examples are added. So each example (or
each dialog, for dialog data) is placed by the SHA-256 of ``seed`` and its own stable key,
never by Python's salted ``hash`` or by its position in the file: the keys are sorted by that
digest, the first ``round(n * fraction)`` form the test split, the next as many the
validation split, and the rest train. Records with users (user-level DP) are placed by user instead
(``user_split``): each user by its own digest against the fractions, so no rank moves when a user is added.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Iterable, Sequence

from dptext.errors import UserError

SPLITS = ("train", "validation", "test")
_ALIASES = {"dev": "validation", "valid": "validation", "val": "validation", "eval": "validation"}


def canonical_split(split: str) -> str:
    """``train``/``validation``/``test``, accepting dev/valid/val as validation."""
    name = _ALIASES.get(split.strip().lower(), split.strip().lower())
    if name not in SPLITS:
        raise UserError(f"Unknown split {split!r}; use one of train, validation, test.")
    return name


def check_fraction(validation_fraction: float) -> float:
    if not 0.0 <= validation_fraction < 0.5:
        raise UserError(
            f"data.validation_fraction={validation_fraction} is out of range; it must be at least 0 and below 0.5 "
            "(the same fraction is held out again for test)."
        )
    return float(validation_fraction)


def _digest(seed: int, key: str) -> bytes:
    return hashlib.sha256(f"{seed}\x00{key}".encode("utf-8")).digest()


def seeded_order(keys: Iterable[str], seed: int) -> list[str]:
    """The distinct keys in the seed's fixed pseudo-random order."""
    return sorted(set(keys), key=lambda k: (_digest(seed, k), k))


def partition_keys(keys: Iterable[str], validation_fraction: float, seed: int) -> dict[str, str]:
    """Map every distinct key to ``train``, ``validation`` or ``test``."""
    fraction = check_fraction(validation_fraction)
    unique = seeded_order(keys, seed)
    n_held = round(len(unique) * fraction)
    assignment = {}
    for rank, key in enumerate(unique):
        if rank < n_held:
            assignment[key] = "test"
        elif rank < 2 * n_held:
            assignment[key] = "validation"
        else:
            assignment[key] = "train"
    return assignment


def seeded_split(
    records: Sequence[dict[str, Any]],
    split: str,
    key: Callable[[dict[str, Any]], str],
    validation_fraction: float,
    seed: int,
) -> list[dict[str, Any]]:
    """The records of one split of a seeded partition, in their original order.

    ``key`` gives the unit that must stay together (a review's id, a dialog's id), so that
    no dialog is split across train and test.
    """
    assignment = partition_keys((key(r) for r in records), validation_fraction, seed)
    wanted = canonical_split(split)
    return [r for r in records if assignment[key(r)] == wanted]


def user_split(records: Sequence[dict[str, Any]], split: str, key: Callable[[dict[str, Any]], str],
               validation_fraction: float, seed: int) -> list[dict[str, Any]]:
    """The records of one split when records carry users (user-level DP): all of a user's records go to one split,
    so validation and test hold users training never saw, and a user's split is a function of its own id alone
    (its keyed digest against the fractions, not its rank among the others), so adding or removing one user
    moves no other user between splits. Records without a user are placed the same way by ``key``."""
    fraction = check_fraction(validation_fraction)
    wanted = canonical_split(split)

    def place(record: dict[str, Any]) -> str:
        user = record.get("user")
        unit = f"user\x00{user}" if isinstance(user, str) and user else f"record\x00{key(record)}"
        share = int.from_bytes(_digest(seed, unit)[:8], "big") / 2 ** 64
        return "test" if share < fraction else "validation" if share < 2 * fraction else "train"
    return [r for r in records if place(r) == wanted]


def halve_seeded(
    records: Sequence[dict[str, Any]], split: str, key: Callable[[dict[str, Any]], str], seed: int
) -> list[dict[str, Any]]:
    """Split one held-out set into validation and test halves (for hub copies without validation).

    Used where the only way to get a validation split would otherwise be to take it out of
    train, which would change the training-set size that privacy accounting relies on.
    """
    keys = seeded_order((key(r) for r in records), seed)
    validation_keys = set(keys[: len(keys) // 2])
    wanted = canonical_split(split)
    if wanted == "train":
        raise ValueError("halve_seeded splits a held-out set; it has no train part")
    return [r for r in records if (key(r) in validation_keys) == (wanted == "validation")]
