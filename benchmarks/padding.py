"""How much a micro-batch pads: real tokens vs padded tokens, rows cut in sampled order vs shortest first.

    python benchmarks/padding.py recipes/sst2-minilm-dp.yaml data.path=../shared/data/sst2
    python benchmarks/padding.py recipes/amazon-user-level.yaml data.path=../shared/data/amazon_multidomain_sentiment

A micro-batch pads every row to its longest one, so the order in which a step's sampled rows are cut into
micro-batches of ``train.physical_batch_size`` decides the tokens a step computes. This draws ``--steps`` Poisson
batches at the recipe's q (a public seed: it measures cost, it trains nothing) from the recipe's tokenized training
set and prints padded ÷ real tokens for the sampled order and for the order finetune uses (``loop.shortest_first``;
user-level recipes: ``user_level.shortest_users_first``, each user's rows kept together, at most k per user). The
ratio is the factor of wasted forward/backward work; the step time follows it where the model's cost is linear
in tokens.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dptext import config  # noqa: E402  (after the path: runs from a checkout without installing)
from dptext.accounting import plan_for_recipe  # noqa: E402
from dptext.data.users import user_groups  # noqa: E402
from dptext.errors import UserError  # noqa: E402
from dptext.finetune.loop import micro_batches  # noqa: E402
from dptext.finetune.setup import load_splits  # noqa: E402
from dptext.finetune.user_level import micro_batches_by_user, shortest_users_first, user_level  # noqa: E402
from dptext.models import load_tokenizer  # noqa: E402
from dptext.tasks import build_task  # noqa: E402


def padded_tokens(lengths: list[int], chunks: list[list[int]]) -> int:
    """Tokens computed when each chunk (row positions into ``lengths``) pads to its longest row."""
    return sum(len(chunk) * max(lengths[i] for i in chunk) for chunk in chunks if chunk)


def example_chunks(indices: list[int], lengths: list[int], size: int, sort: bool) -> list[list[int]]:
    ordered = sorted(indices, key=lambda i: lengths[i]) if sort else indices  # loop.shortest_first, on lengths
    return list(micro_batches(ordered, size))


def user_chunks(indices: list[int], users: list[int], lengths: list[int], size: int, sort: bool) -> list[list[int]]:
    if sort:
        indices, users = shortest_users_first([lengths[i] for i in indices], indices, users)
    return [rows for rows, _ in micro_batches_by_user(indices, users, size)]


def measure(recipe, steps: int, seed: int) -> dict:
    train, _, _ = load_splits(recipe)
    task = build_task(recipe, load_tokenizer(recipe.model.name), train)
    lengths = [len(example.input_ids) for example in task.encode(train)]
    by_user = user_level(recipe)
    groups = user_groups(train) if by_user else [[i] for i in range(len(train))]
    plan = plan_for_recipe(recipe, len(groups))
    size = recipe.train.physical_batch_size or 32
    k = recipe.privacy.max_examples_per_user if by_user else 1
    rng = random.Random(seed)
    real = sampled = sorted_ = 0
    for _ in range(steps):
        drawn = [(rng.sample(own, min(k, len(own))), user) for user, own in enumerate(groups)
                 if rng.random() < plan.sample_rate]
        indices = [i for rows, _ in drawn for i in rows]
        owners = [user for rows, user in drawn for _ in rows]
        real += sum(lengths[i] for i in indices)
        if by_user:
            sampled += padded_tokens(lengths, user_chunks(indices, owners, lengths, size, sort=False))
            sorted_ += padded_tokens(lengths, user_chunks(indices, owners, lengths, size, sort=True))
        else:
            sampled += padded_tokens(lengths, example_chunks(indices, lengths, size, sort=False))
            sorted_ += padded_tokens(lengths, example_chunks(indices, lengths, size, sort=True))
    return {"recipe": recipe.name, "unit": "user" if by_user else "example", "rows": len(lengths),
            "sample_rate": plan.sample_rate, "physical_batch_size": size, "steps": steps,
            "padded_over_real_sampled_order": sampled / real, "padded_over_real_shortest_first": sorted_ / real}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    parser.add_argument("--steps", type=int, default=20, help="Poisson batches to draw")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        result = measure(config.load_recipe(args.recipe, args.overrides), args.steps, args.seed)
    except UserError as error:  # bad recipe, path or data: the one sentence, not a traceback
        parser.exit(2, f"error: {error}\n")
    for key, value in result.items():
        print(f"{key:34} {value:.3f}" if isinstance(value, float) else f"{key:34} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
