"""`dptext data`: check a dataset before training: records per split and the first few records."""

from __future__ import annotations

from typing import Optional

import typer
from typing_extensions import Annotated

from dptext.cli.common import JsonOption, make_output

PRIVATE_NOTE = ("the records, labels and counts shown are your data as it is, not covered by any differential-privacy "
                "guarantee: keep this output with the private data and never paste it into logs or issues.")


def data(
    dataset: Annotated[str, typer.Argument(help="Dataset name: e2e, dart, sst2, qnli, mnli, qqp, atis, snips, amazon, "
                                                "imdb, yelp, chitchat, personachat, news, jsonl, csv or tsv.",
                                           show_default=False)],
    path: Annotated[Optional[str], typer.Option("--path", help="Local file or folder to read (data.path); empty "
                                                "means the Hugging Face hub or the installed package.")] = None,
    split: Annotated[Optional[str], typer.Option("--split", help="Only this split: train, validation or test "
                                                 "(default: count all three).")] = None,
    show: Annotated[int, typer.Option("--show", min=0, help="How many records to print.")] = 3,
    text_column: Annotated[Optional[str], typer.Option("--text-column", help="Text column of jsonl/csv/tsv data "
                                                       "(data.text_column).")] = None,
    label_column: Annotated[Optional[str], typer.Option("--label-column", help="Label column of jsonl/csv/tsv data "
                                                        "(data.label_column).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the split for sources without one "
                                      "(data.split_seed).")] = 0,
    validation_fraction: Annotated[float, typer.Option("--validation-fraction", help="Held-out fraction for "
                                                       "validation, and again for test, where the source has no "
                                                       "split (data.validation_fraction).")] = 0.1,
    user_column: Annotated[Optional[str], typer.Option("--user-column", help="Column naming each record's user "
                                                       "(data.user_column; `reviewer` for amazon): adds examples "
                                                       "per user, as counts only.")] = None,
    json_mode: JsonOption = False,
) -> None:
    """Show how many records each split of a dataset has and print the first ones (private data, printed as is:
    no DP guarantee covers this output)."""
    from dptext.data.summary import example_table, statistics_rows, summarize, user_rows

    out = make_output(json_mode)
    summary = summarize(dataset, path, split, show, text_column=text_column, label_column=label_column,
                        split_seed=seed, validation_fraction=validation_fraction, user_column=user_column)
    # the one command that prints records on purpose (the owner inspecting their data): say what the output is
    out.warn(PRIVATE_NOTE)
    out.info(f"{summary['dataset']} from {summary['source']}")
    rows = [[name, "-" if count is None else f"{count:,}"] for name, count in summary["counts"].items()]
    out.table("Records per split", ["split", "records"], rows)
    if summary["statistics"]:
        out.table("Texts and labels", ["split", "text", "empty", "words min / median / max", "labels (count)"],
                  statistics_rows(summary["statistics"]))
    if summary["users"]:
        spread, bounds = user_rows(summary["users"])
        out.table("Examples per user (counts only)", ["split", "users", "examples with a user", "no user",
                                                      "per user min / median / mean / max"], spread)
        out.table("Contribution bound k (privacy.max_examples_per_user)",
                  ["split", "k", "users with more than k", "Σ min(examples, k): used by a step sampling every user"],
                  bounds)
    for name, message in summary["errors"].items():
        out.warn(f"{name}: {message}")
    if summary["examples"]:
        columns, cells = example_table(summary["examples"])
        out.table(f"First {len(cells)} {summary['shown_split']} records", columns, cells)
    out.result(summary)


def register(app: typer.Typer) -> None:
    app.command("data")(data)
