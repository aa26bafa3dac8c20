"""Shared test fixtures.

Tests may read the real datasets in ../shared/data (next to the checkout); the package
itself never depends on them. Tests that need them are skipped with a reason when the
folder is absent (e.g. a user's clone), but in this project's CI it is always present.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("DPTEXT_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared datasets not found at {SHARED_DATA} (set DPTEXT_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture
def reviews(tmp_path) -> Path:
    """48 one-line labelled reviews (reviews.jsonl: text, label 0/1), for short classification runs."""
    import json

    path = tmp_path / "reviews.jsonl"
    path.write_text("".join(json.dumps({"text": f"review {i} {'good' if i % 2 else 'bad'}", "label": i % 2}) + "\n"
                            for i in range(48)))
    return path


@pytest.fixture(autouse=True)
def _isolated_cwd_for_runs(monkeypatch, tmp_path_factory):
    """Keep tests from writing runs/ into the checkout."""
    monkeypatch.setenv("DPTEXT_RUNS_ROOT", str(tmp_path_factory.mktemp("runs")))


@pytest.fixture(scope="module")
def gpt2():
    """(model, tokenizer) of the tiny random GPT-2 (tied embeddings, byte-level vocabulary of 261)."""
    from dptext.models import load_model

    return load_model("tiny-gpt2")


@pytest.fixture(scope="module")
def roberta():
    """(model, tokenizer) of the tiny random RoBERTa with its (tied) masked-LM head."""
    from dptext.models import load_model

    return load_model("tiny-roberta", head="masked_lm")


@pytest.fixture
def interrupt_training(monkeypatch):
    """``interrupt_training(n)`` makes the n-th training step raise KeyboardInterrupt (a kill mid-run, before the
    step's checkpoint); the function it returns puts the real step back, for the resume."""
    from dptext.finetune import loop

    real_step = loop.train_step

    def arm(at_call: int):
        calls = {"n": 0}

        def interrupted_step(training, sampled):
            calls["n"] += 1
            if calls["n"] == at_call:
                raise KeyboardInterrupt
            return real_step(training, sampled)

        monkeypatch.setattr(loop, "train_step", interrupted_step)
        return lambda: monkeypatch.setattr(loop, "train_step", real_step)

    return arm


@pytest.fixture(autouse=True)
def _probe_cuts_the_tiny_vocabularies(monkeypatch):
    """The start-up probe's second shape runs on the first rows of a large vocabulary (``proof.vocabulary``); the
    tiny test models' vocabularies (a few hundred ids) are cut to 16 rows, so every probe in the suite takes that
    path wherever a model has 32 ids or more."""
    from dptext.privacy.proof import vocabulary

    monkeypatch.setattr(vocabulary, "KEPT_ROWS", 16)
