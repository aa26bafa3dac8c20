"""The final evaluation's finished batches on disk, so an interrupted evaluation resumes where it stopped.

On the CPU, beam search over E2E's 630 test inputs and the perplexity of its 4,693 references take about as long
as the training before them; a run cut off there would redo all of it on ``--resume``. Each finished batch is
appended to the journal as one JSON line (flushed and fsynced: a kill loses at most the batch being computed).

The first line is the journal's identity: the training step, a hash of the weights, a hash of the records and the
evaluation settings. A journal whose identity differs from the evaluation about to run is started afresh, so no
batch computed for other weights, other records or other settings is ever reused.

Each batch also keeps the seconds it took, so that a resumed run's wall time can count the work it did not redo
(``reused_seconds``; a function of the DP model and the evaluation split, like the batch's values).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from dptext.runs import append_json_line, atomic_write_text, read_lines


def weights_digest(model: Any) -> str:
    """SHA-256 of every parameter and buffer, by name: equal digests mean the evaluation sees the same model."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def records_digest(records: Sequence[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(list(records), sort_keys=True, default=str).encode()).hexdigest()


class EvaluationJournal:
    """``part`` names a pass of the evaluation ("generate", "perplexity"); a batch is found by its start index."""

    def __init__(self, path: str | Path, identity: dict[str, Any]):
        self.path = Path(path)
        self.identity = identity
        self.done: dict[tuple[str, int], Any] = {}
        self.seconds: dict[tuple[str, int], float] = {}  # what each batch on disk took when it was computed
        self.reused_seconds = 0.0  # of the batches this evaluation took from disk instead of computing them
        lines = read_lines(self.path) if self.path.exists() else []
        if lines and _loads(lines[0]) == {"identity": identity}:
            for line in lines[1:]:
                entry = _loads(line)
                if entry is not None:  # None: the line a kill tore mid-write; that batch is computed again
                    self.done[(entry["part"], entry["start"])] = entry["value"]
                    self.seconds[(entry["part"], entry["start"])] = entry.get("seconds", 0.0)
        else:
            atomic_write_text(self.path, json.dumps({"identity": identity}) + "\n")

    def record(self, part: str, start: int, value: Any, seconds: float = 0.0) -> None:
        self.done[(part, start)] = value
        if _finite(value):  # JSON has no NaN/inf (they would come back as strings): such a batch is computed again
            append_json_line(self.path, {"part": part, "start": start, "value": value, "seconds": seconds})

    def reuse(self, part: str, start: int) -> Any:
        self.reused_seconds += self.seconds.get((part, start), 0.0)
        return self.done[(part, start)]


def journaled_batches(items: Sequence[Any], size: int, compute: Callable[[list[Any]], Any],
                      journal: EvaluationJournal | None, part: str) -> Iterator[tuple[list[Any], Any]]:
    """(batch, compute(batch)) for consecutive batches of ``items``; a batch the journal holds is not computed
    again, and every computed one is recorded (``compute`` must return JSON: lists, strings, numbers)."""
    for start in range(0, len(items), size):
        chunk = list(items[start:start + size])
        if journal is not None and (part, start) in journal.done:
            yield chunk, journal.reuse(part, start)
            continue
        started = time.monotonic()
        value = compute(chunk)
        if journal is not None:
            journal.record(part, start, value, time.monotonic() - started)
        yield chunk, value


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_finite(item) for item in value)
    return True


def _loads(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None
