"""Users of records, for user-level DP (issue 24): one privacy unit = all of a user's examples.

When ``data.user_column`` is set, a reader puts each record's user id in ``record["user"]`` (a non-empty ``str``,
or None where the record names no user); ``load_split`` then applies ``data.missing_user`` to the training split:
``refuse`` (the default) stops with one sentence that says how many records lack a user, ``drop`` removes them
(a public rule that looks at each record alone, so it leaks nothing about other records). Validation and test
records keep None: they are never trained on, so their users bound nothing.

User ids are private data (a reviewer's name is personal): nothing here prints, logs or writes them, and error
messages give counts and positions only. ``user_statistics`` gives counts, never ids.
"""

from __future__ import annotations

import hashlib
import statistics
from typing import Any, Optional

from dptext.errors import UserError

USER = "user"
MISSING_USER_POLICIES = ("refuse", "drop", "keep")  # keep: only for inspection (`dptext data`), never in a recipe
# the contribution bounds `dptext data` shows; those at or above the largest user add nothing and are left out
BOUNDS = (1, 2, 3, 5, 10, 20, 50, 100)


def user_id(value: Any) -> Optional[str]:
    """The user id a column value names, trimmed; None for a missing or blank value (a number becomes its text)."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 12.0 from a spreadsheet is user 12
    text = str(value).strip()
    return text or None


def without_missing_users(records: list[dict], split: str, policy: str, where: str) -> list[dict]:
    """The records of ``split`` under ``data.missing_user``: only the training split is checked (see module docs)."""
    if policy not in MISSING_USER_POLICIES:
        raise UserError(f"data.missing_user={policy!r} is not one of refuse, drop.")
    if any(USER not in record for record in records):  # a reader that ignored data.user_column: never guess
        raise UserError(f"The {where} reader did not give every record a user; data.user_column cannot be used "
                        "with it.")
    missing = sum(record[USER] is None for record in records)
    if split != "train" or policy == "keep" or not missing:
        return records
    if policy == "refuse":
        raise UserError(f"{missing:,} of {len(records):,} training records of {where} have no user, so their "
                        "contribution cannot be bounded; fill in the user column or set data.missing_user=drop to "
                        "train without them.")
    return [record for record in records if record[USER] is not None]


def user_groups(records: list[dict]) -> list[list[int]]:
    """For each user (in order of first appearance), the indices of its records: ``UserPoissonSampler``'s ``users``.

    A record without a user is refused here too, so a caller that skipped ``load_split`` still fails closed.
    """
    groups: dict[str, list[int]] = {}
    for index, record in enumerate(records):
        user = record.get(USER)
        if not isinstance(user, str) or not user:
            raise UserError(f"Training record {index + 1} has no user; set data.user_column (and "
                            "data.missing_user=drop to train without records that lack one).")
        groups.setdefault(user, []).append(index)
    return list(groups.values())


def first_users(records: list[dict], limit: int, seed: int | None) -> list[dict]:
    """The records of ``limit`` whole users (``data.max_train_users``), in file order: the first users by first
    appearance, or (given a seed) the users whose keyed hash of (seed, id) ranks lowest. Either rule looks at each
    user's id or first position only, never at record counts, so removing a kept user from the data lets at most
    one other whole user in (a record cut would let parts of many users in). Records without a user belong to no
    kept user and are left out (the training split refuses or drops them before this anyway)."""
    order: dict[str, int] = {}
    for record in records:
        user = record.get(USER)
        if isinstance(user, str) and user:
            order.setdefault(user, len(order))
    if seed is not None:  # a keyed hash of the id alone: a user's rank does not depend on the file's order
        def digest(user: str) -> bytes:
            return hashlib.sha256(f"{seed}\x00{user}".encode("utf-8")).digest()
        ranked = sorted(order, key=lambda user: (digest(user), user))
    else:
        ranked = sorted(order, key=order.__getitem__)
    kept = set(ranked[:limit])
    return [record for record in records if record.get(USER) in kept]


def user_statistics(records: list[dict], bounds: tuple = BOUNDS) -> dict[str, Any]:
    """Examples per user of one split, as counts only: users, min/median/mean/max examples per user, and for each
    contribution bound k how many users have more than k examples and ``examples_kept`` = Σ_u min(n_u, k), the
    examples a step that sampled every user would use (a user with more than k gives a random k of them per step)."""
    per_user: dict[str, int] = {}
    missing = 0
    for record in records:
        user = record.get(USER)
        if user is None:
            missing += 1
        else:
            per_user[user] = per_user.get(user, 0) + 1
    counts = sorted(per_user.values())
    if not counts:
        return {"users": 0, "examples": 0, "missing_user": missing, "per_user": None, "bounds": []}
    largest = counts[-1]
    chosen = [k for k in bounds if k < largest] + [largest]
    return {"users": len(counts), "examples": sum(counts), "missing_user": missing,
            "per_user": {"min": counts[0], "median": statistics.median(counts), "mean": sum(counts) / len(counts),
                         "max": largest},
            "bounds": [{"k": k, "users_over_k": sum(n > k for n in counts),
                        "examples_kept": sum(min(n, k) for n in counts)} for k in chosen]}
