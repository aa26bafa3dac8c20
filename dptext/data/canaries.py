"""Canaries for the secret-sharer test: '<prefix> <w1> <w2> ... <wk>' with words from a fixed, seeded list.

``make_canaries(audit)`` draws the secrets (one group of ``audit.canaries`` canaries per repetition count),
``canary_record(task_type, ...)`` turns one into a training record of the recipe's task, ``canary_user`` names
the synthetic user of a canary's copies (``audit.canary_unit``: one user per copy, or one per canary), and
``sample_candidates`` draws the comparison secrets from the same space R = vocabulary^words.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

from dptext.errors import UserError

# A fixed list of everyday words; a seeded subset of ``audit.canary_vocabulary`` of them forms the vocabulary.
WORDS = """
apple river table window garden silver orange pencil yellow forest candle bottle rabbit mirror pillow ladder
button rocket planet bridge circle dragon engine feather guitar hammer island jacket kettle lemon magnet
needle ocean parrot pepper puzzle saddle shadow spider tiger tomato turtle violin wallet walnut whistle zebra
anchor basket blanket bucket cactus camera carpet castle cherry cookie copper cotton crayon desert doctor
donkey eagle falcon farmer fence finger flower fossil frost galaxy ginger glove goose helmet honey horse
jungle kitten ladle lantern leaf lizard lobster marble meadow melon monkey muffin napkin nickel noodle
orchid otter oyster paddle panda paper peach pebble pirate plum pocket pony potato pumpkin quilt radio
raven ribbon robot saucer scarf shovel sketch sock spoon squirrel stamp statue sugar sunset swan teapot
thunder tulip tunnel umbrella valley velvet wagon walrus wheel willow wizard yogurt acorn badge bamboo
beacon beetle biscuit blossom bonnet bramble breeze bubble butter canyon cargo cedar chalk cider clover
cobalt comet coral crater cricket crystal dagger daisy denim dolphin dune ember fable fern fiddle flint
fog fountain fudge gadget garlic glacier goblet granite gravel harbor hazel heron hive holly hornet iris
ivory jasmine jigsaw kayak kernel kiwi lagoon lava lilac linen maple marsh meteor mint moss nectar nutmeg
oak olive opal orbit paprika pearl pine plaza prism quartz quill raisin reef saffron sage satin sequoia
""".split()


def vocabulary(size: int, seed: int) -> list[str]:
    if not 2 <= size <= len(WORDS):
        raise UserError(f"audit.canary_vocabulary={size} must lie between 2 and {len(WORDS)} (the fixed word list).")
    return sorted(random.Random(f"canary-vocabulary-{seed}").sample(WORDS, size))


def space_size(audit: Any) -> int:
    """|R|: the number of possible secrets."""
    return audit.canary_vocabulary ** audit.canary_words


def make_canaries(audit: Any) -> dict[str, Any]:
    """The canaries of a recipe's ``audit`` section (secrets distinct), with everything needed to re-rank them."""
    words = vocabulary(audit.canary_vocabulary, audit.seed)
    if audit.canary_words < 1:
        raise UserError("audit.canary_words must be at least 1.")
    repetitions = [int(r) for r in audit.canary_repetitions]
    if not repetitions or any(r < 1 for r in repetitions):
        raise UserError("audit.canary_repetitions must list positive repetition counts, e.g. [1, 10].")
    total = audit.canaries * len(repetitions)
    if total > space_size(audit) // 2:
        raise UserError("More canaries than half the secret space; raise audit.canary_vocabulary or canary_words.")
    rng = random.Random(f"canary-secrets-{audit.seed}")
    secrets: list[str] = []
    while len(secrets) < total:
        secret = " ".join(rng.choice(words) for _ in range(audit.canary_words))
        if secret not in secrets:
            secrets.append(secret)
    canaries = [{"secret": secret, "repetitions": repetitions[i // audit.canaries]}
                for i, secret in enumerate(secrets)]
    return {"prefix": audit.canary_prefix, "vocabulary": words, "words": audit.canary_words,
            "space_size": space_size(audit), "canaries": canaries, "unit": audit.canary_unit}


def make_one_run_canaries(audit: Any) -> dict[str, Any]:
    """The one-run audit's m canaries: distinct secrets (none an exposure canary's), each included independently
    with probability ½ by a coin seeded with ``audit.seed`` (public randomness, never the data)."""
    words = vocabulary(audit.canary_vocabulary, audit.seed)
    taken = {c["secret"] for c in make_canaries(audit)["canaries"]} if audit.canaries else set()
    if audit.one_run_canaries + len(taken) > space_size(audit) // 2:
        raise UserError("More canaries than half the secret space; raise audit.canary_vocabulary or canary_words.")
    rng, coin = random.Random(f"one-run-secrets-{audit.seed}"), random.Random(f"one-run-inclusion-{audit.seed}")
    secrets: list[str] = []
    while len(secrets) < audit.one_run_canaries:
        secret = " ".join(rng.choice(words) for _ in range(audit.canary_words))
        if secret not in taken and secret not in secrets:
            secrets.append(secret)
    return {"prefix": audit.canary_prefix, "inclusion": "independent, probability 1/2, coins seeded by audit.seed",
            "canaries": [{"secret": secret, "included": coin.random() < 0.5} for secret in secrets]}


def canary_user(seed: int, number: int, unit: str, copy: int) -> str:
    """The synthetic user id of copy ``copy`` of canary ``number``: one user for all copies (unit ``user``), or one
    per copy (``example``), so a canary is one person repeating a secret or that many people sharing it."""
    return f"canary-{seed}-{number}" if unit == "user" else f"canary-{seed}-{number}-copy-{copy}"


def canary_record(task_type: str, prefix: str, secret: str, control_codes: list | None = None) -> dict[str, Any]:
    """A training record of ``task_type`` whose completion is the secret (the prefix is the prompt or text start)."""
    if task_type == "language_modeling":
        return {"text": f"{prefix} {secret}", **{name: "canary" for name in control_codes or []}}
    if task_type == "table_to_text":
        return {"mr": prefix, "ref": secret}
    if task_type == "dialog":
        return {"history": [prefix], "response": secret}
    raise UserError(f"Canaries need a language-model task (language_modeling, table_to_text, dialog); "
                    f"task.type={task_type} has no text to memorise, so set audit.canaries=0.")


def sample_candidates(canaries: dict[str, Any], count: int, seed: int) -> tuple[list[str], bool]:
    """(candidate secrets, exhaustive): all of R minus the canaries when |R| ≤ count, else ``count`` uniform draws."""
    words, k = canaries["vocabulary"], canaries["words"]
    inserted = {c["secret"] for c in canaries["canaries"]}
    if canaries["space_size"] <= count:
        every = (" ".join(combo) for combo in itertools.product(words, repeat=k))
        return [s for s in every if s not in inserted], True
    rng = random.Random(f"canary-candidates-{seed}")
    drawn = []
    while len(drawn) < count:
        secret = " ".join(rng.choice(words) for _ in range(k))
        if secret not in inserted:
            drawn.append(secret)
    return drawn, False
