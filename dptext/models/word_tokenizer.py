"""The word and character tokenizer of the CLC encoder (``dptext.tasks.clc``), over fixed public vocabularies.

Vocabularies are public and fixed, never built from the training split (a vocabulary read off the private
records would ship every word they contain with the model): the words are the whole-word entries of the
pretrained minilm-l6 (BERT uncased) WordPiece vocabulary, the characters printable ASCII; anything else is <unk>.
"""

from __future__ import annotations

import json
import re
import string
from pathlib import Path
from typing import Sequence

PAD, UNK = 0, 1
VOCAB_FILE = "clc_vocabulary.json"
MAX_WORD_CHARS = 20  # longer words keep their first 20 characters
WHOLE_WORD = re.compile(r"[a-z0-9][a-z0-9'\-]*")
_PUBLIC: tuple[list[str], list[str]] | None = None


class WordTokenizer:
    """Word and character ids from a public vocabulary (0 = padding, 1 = unknown)."""

    pad_token_id = PAD

    def __init__(self, words: Sequence[str] = (), chars: Sequence[str] = ()):
        self.words = {w: i for i, w in enumerate(["<pad>", "<unk>", *words])}
        self.chars = {c: i for i, c in enumerate(["<pad>", "<unk>", *chars])}

    @classmethod
    def public(cls, pieces: dict[str, int]) -> "WordTokenizer":
        """The fixed public vocabulary: minilm-l6's whole words (no ## pieces, no [special] tokens; ``pieces`` is
        its WordPiece vocabulary) and the printable ASCII characters. Built once per process: every clc run sees
        the same ids."""
        global _PUBLIC
        if _PUBLIC is None:
            words = sorted(w for w in pieces if WHOLE_WORD.fullmatch(w))
            _PUBLIC = (words, sorted(set(string.printable) - set(string.whitespace)))
        return cls(*_PUBLIC)

    def encode_words(self, tokens: Sequence[str]) -> tuple[list[int], list[list[int]]]:
        words = [self.words.get(t.lower(), UNK) for t in tokens]
        chars = [[self.chars.get(c, UNK) for c in t[:MAX_WORD_CHARS]] for t in tokens]
        return words, chars

    def save_pretrained(self, path: str | Path) -> None:
        (Path(path) / VOCAB_FILE).write_text(json.dumps({"words": list(self.words), "chars": list(self.chars)}))
