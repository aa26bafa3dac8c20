"""User-level DP in fine-tuning (issue 24): the recipe's checks, users from records, micro-batches by user.

With ``privacy.unit=user`` the privacy unit is every training record of one user (``record["user"]``, which the
data layer fills from ``data.user_column``). The engine is accounted over users (q = train.batch_size / users),
its user sampler draws each user with probability q and at most k = privacy.max_examples_per_user of their
examples, and all of one user's rows go into one ``engine.accumulate(loss, units=...)`` call, so the user's
summed gradient is clipped to C as one vector and removing a user moves the clipped sum by at most C.
"""

from __future__ import annotations

from typing import Any, Iterator

from dptext.data import held_out_users
from dptext.errors import UserError

COUNTS_HINT = "`dptext data NAME --path P --user-column COLUMN` shows how many examples each user has"


def user_level(recipe: Any) -> bool:
    """Whether a recipe trains with user-level DP (a non-private baseline has no unit: it samples examples)."""
    return recipe.privacy.enabled and recipe.privacy.unit == "user"


def check_user_level(recipe: Any) -> None:
    """Refuse, before any data is read, a user-level recipe that cannot be trained exactly."""
    if not user_level(recipe):
        return
    privacy, k = recipe.privacy, recipe.privacy.max_examples_per_user
    if not recipe.data.user_column:
        raise UserError("privacy.unit=user needs data.user_column, the field that names each record's user; set it "
                        "(e.g. data.user_column=reviewer) or use privacy.unit=example.")
    if recipe.data.max_train_examples is not None:  # a record cut lets parts of many users in when one leaves
        raise UserError("data.max_train_examples cuts records, which splits users (removing one user would let "
                        "parts of many others in); under privacy.unit=user use data.max_train_users=N instead.")
    if k is None:
        raise UserError("privacy.unit=user needs privacy.max_examples_per_user (k, the most examples one user "
                        f"contributes to a step); set it ({COUNTS_HINT}).")
    if privacy.method == "edp_sgd":
        raise UserError("eDP-SGD clips micro-batch slots, not users, so it cannot give a user-level guarantee; use "
                        "privacy.method=dp_sgd with privacy.unit=user.")
    physical = recipe.train.physical_batch_size
    if physical is not None and physical < k:
        raise UserError(f"privacy.max_examples_per_user={k} exceeds train.physical_batch_size={physical}, but a "
                        f"user's examples must be clipped in one micro-batch; set train.physical_batch_size to at "
                        f"least {k} or lower privacy.max_examples_per_user.")


def check_single_process(recipe: Any, distributed: bool) -> None:
    if distributed and user_level(recipe):
        raise UserError("privacy.unit=user is not supported under torchrun yet (a user's examples would have to stay "
                        "on one rank); train user-level DP in one process.")


def shortest_users_first(lengths: list[int], indices: list[int], users: list[int]) -> tuple[list[int], list[int]]:
    """(rows, their users) with each user's rows together, users ordered by their longest row (stable) and rows by
    length within a user, so the micro-batches cut from them pad little (as ``loop.shortest_first`` does for
    examples). ``lengths[j]`` is the length of row ``indices[j]``. Each user is clipped as one vector in one
    accumulate call whatever its position, so the order changes the cost, not the clipped sum."""
    rows_of: dict[int, list[tuple[int, int]]] = {}
    for index, user, length in zip(indices, users, lengths):
        rows_of.setdefault(user, []).append((length, index))
    ordered = sorted(rows_of.items(), key=lambda item: max(length for length, _ in item[1]))
    rows = [(index, user) for user, own in ordered for _, index in sorted(own, key=lambda row: row[0])]
    return [index for index, _ in rows], [user for _, user in rows]


def micro_batches_by_user(indices: list[int], users: list[int], size: int) -> Iterator[tuple[list[int], list[int]]]:
    """(rows, their users) in micro-batches of at most ``size`` rows that never split a user: a user split over two
    accumulate calls would be clipped to C twice (the engine refuses that too)."""
    by_user: dict[int, list[int]] = {}
    for index, user in zip(indices, users):
        by_user.setdefault(user, []).append(index)
    rows: list[int] = []
    owners: list[int] = []
    for user, own in by_user.items():
        if len(own) > size:
            raise UserError(f"A user contributes {len(own)} examples but train.physical_batch_size is {size}; set "
                            "train.physical_batch_size to at least privacy.max_examples_per_user.")
        if len(rows) + len(own) > size:
            yield rows, owners
            rows, owners = [], []
        rows += own
        owners += [user] * len(own)
    if rows:
        yield rows, owners


HELD_OUT = "validation and test hold other users than training (the data was split by user)"
NOT_HELD_OUT = ("validation and test were read from your split files, not split by user: they may hold training "
                "users' records, and selection on validation (early stopping, train.keep_best) saw them")


def evaluation_users(recipe: Any) -> str:
    """What a user-level run's evaluation splits hold (result.json and release.json say it): a public rule."""
    return HELD_OUT if held_out_users(recipe.data) else NOT_HELD_OUT


def unit_summary(recipe: Any, users: list[list[int]] | None) -> dict[str, Any]:
    """What the run's ε is about, for result.json: the unit, k and what evaluation saw. The numbers of users and
    of their records are not here: result.json is covered, and removing a user changes them by (1, its records);
    ``training_counts`` puts them in the not-covered diagnostics."""
    if users is None:
        return {"unit": "example"}
    return {"unit": "user", "max_examples_per_user": recipe.privacy.max_examples_per_user,
            "user_column": recipe.data.user_column, "evaluation_users": evaluation_users(recipe)}


def training_counts(users: list[list[int]]) -> dict[str, Any]:
    """Users and training records of a user-level run, for diagnostics_not_private.jsonl (exact counts)."""
    return {"event": "training_data", "users": len(users), "records": sum(len(own) for own in users)}


def user_unit_text(k: int) -> str:
    return (f"one user: every training record with the same data.user_column value, at most {k} of them used per "
            "step (text of one user inside another user's records, e.g. dialog history, is not covered)")
