"""Write the SST-2 tuning split: the GLUE training set cut into a tuning-train and a tuning-validation part.

    python benchmarks/sst2_tuning_split.py ../shared/data/sst2 /work/results-runs/sst2-tuning-data

The SST-2 DP learning rate is searched on this split (benchmarks/jobs.txt, ``sst2-tune-*``), never on the GLUE
validation set docs/results.md reports (GLUE's test labels are not public, so validation is the only reported split).
The output folder reads like any local SST-2 folder: ``train.tsv`` (all but ``--held-out`` training sentences) and
``dev.tsv`` (the held-out ones, a seeded random sample). The same seed always gives the same split.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path


def split_rows(rows: list[str], held_out: int, seed: int) -> tuple[list[str], list[str]]:
    """(tuning-train, tuning-validation) rows, each in the original order; raises ValueError if too few rows."""
    if not 0 < held_out < len(rows):
        raise ValueError(f"cannot hold out {held_out} of {len(rows)} training rows")
    chosen = set(random.Random(seed).sample(range(len(rows)), held_out))
    train = [row for i, row in enumerate(rows) if i not in chosen]
    validation = [row for i, row in enumerate(rows) if i in chosen]
    return train, validation


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="GLUE SST-2 folder with train.tsv")
    parser.add_argument("out", type=Path, help="folder to write train.tsv and dev.tsv into")
    parser.add_argument("--held-out", type=int, default=2000, help="training sentences held out for tuning")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    source = args.source / "train.tsv"
    if not source.is_file():
        parser.error(f"{source} does not exist; give the folder that holds GLUE SST-2's train.tsv")
    header, *rows = source.read_text(encoding="utf-8").splitlines(keepends=True)
    try:
        train, validation = split_rows(rows, args.held_out, args.seed)
    except ValueError as error:
        parser.error(f"{error}; choose a smaller --held-out")
    args.out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.tsv", train), ("dev.tsv", validation)):
        partial = args.out / f".{name}.partial"
        partial.write_text(header + "".join(part), encoding="utf-8")
        partial.replace(args.out / name)  # never a half-written split
    print(f"{args.out}: train.tsv {len(train)} rows, dev.tsv {len(validation)} rows (seed {args.seed})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
