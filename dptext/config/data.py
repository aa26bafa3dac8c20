"""The ``data`` section of a recipe: the dataset reader, its source and how much of it is used."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from dptext.config.fields import doc


@dataclass
class DataConfig:
    dataset: Optional[str] = doc(None, "Dataset reader: e2e, dart, sst2, qnli, mnli, qqp, atis, snips, amazon, "
                                 "imdb, yelp, chitchat, personachat, news, jsonl, csv, tsv (`dptext data --help`). "
                                 "Empty: jsonl/csv/tsv from data.path's extension, e2e when no path is set.")
    path: Optional[str] = doc(None, "Local file or folder to read; empty means the Hugging Face hub "
                              "(or the installed package for imdb/chitchat/news).")
    text_column: Optional[str] = doc(None, "Text column for generic jsonl/csv data.")
    label_column: Optional[str] = doc(None, "Label column for generic jsonl/csv data.")
    max_train_examples: Optional[int] = doc(
        None, "Use only the first N training examples (after the seeded split).", ge=1)
    max_train_users: Optional[int] = doc(
        None, "Use only N whole users of the training split (needs data.user_column; privacy.unit=user cuts by "
        "users, never by records): the first N users in order of first appearance, or with data.sample_seed a "
        "seeded sample of N users (a keyed hash of each user id). Removing a kept user lets at most one other "
        "whole user in, as removing a record does under max_train_examples.", ge=1,
        excludes="data.max_train_examples")
    max_eval_examples: Optional[int] = doc(None, "Evaluate on only the first N validation/test examples.", ge=0)
    sample_seed: Optional[int] = doc(None, "Take max_train_examples / max_eval_examples as a seeded random sample "
                                     "of the split (kept in file order) instead of its first N records (and "
                                     "max_train_users as a seeded sample of users); files sorted by class or "
                                     "category need it for a representative slice.", ge=0)
    max_length: int = doc(128, "Maximum tokens per example; longer examples are truncated.", ge=1)
    validation_fraction: float = doc(0.1, "Held-out fraction when the source has no validation split.", ge=0, lt=1)
    split_seed: int = doc(0, "Seed of the deterministic split for sources without official splits.", ge=0)
    user_column: Optional[str] = doc(None, "The column naming each example's user (author, speaker, customer) "
                                     "for user-level DP (privacy.unit=user): a jsonl/csv/tsv column, or `reviewer` "
                                     "for amazon. Empty: no users (example-level DP).")
    missing_user: Literal["refuse", "drop"] = doc(
        "refuse", "Training records with no user (missing or blank user column): refuse to train, or drop them "
        "(a rule on each record alone).")
