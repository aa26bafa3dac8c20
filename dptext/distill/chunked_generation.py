"""Resumable chunked generation for ``dptext synth``: each batch of codes prompts the teacher and lands on disk
as one atomically written part file, so an interrupted run resumes at the first missing part and writes exactly
what a straight-through run writes (a batch's sampling RNG is seeded from (seed, batch index) alone)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from dptext.runs import atomic_write_text, read_lines
from dptext.tasks.text_format import control_code

CHUNKS = "chunks"
SEED_STRIDE = 1_000_003  # batch b of seed s samples with torch seed s·STRIDE + b


def code_text(fields: Sequence[str], code: Sequence[Any]) -> str:
    return control_code(dict(zip(fields, code)), fields)


def generate_batch(model: Any, tokenizer: Any, prompts: list[str], settings: dict[str, Any],
                   torch_seed: int) -> tuple[list[str], list[int]]:
    """Sampled completions of ``prompts`` (text and generated-token count, EOS excluded)."""
    device = next(model.parameters()).device
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left",
                      add_special_tokens=False).to(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(torch_seed)
        sequences = model.generate(**batch, do_sample=True, top_k=settings["top_k"], top_p=settings["top_p"],
                                   temperature=settings["temperature"], max_new_tokens=settings["max_new_tokens"],
                                   pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    texts, lengths = [], []
    for row in sequences[:, batch["input_ids"].shape[1]:].tolist():
        if tokenizer.eos_token_id in row:
            row = row[:row.index(tokenizer.eos_token_id)]
        texts.append(tokenizer.decode(row, skip_special_tokens=True).strip())
        lengths.append(len(row))
    return texts, lengths


def completed_chunks(out: Path) -> int:
    """Batches already on disk: part files are written atomically and in order."""
    return len(sorted((out / CHUNKS).glob("part-*.jsonl"))) if (out / CHUNKS).is_dir() else 0


def generate_all(model: Any, tokenizer: Any, plan: dict[str, Any], out: Path, batch_size: int, output: Any,
                 max_chunks: int | None = None) -> dict[str, float]:
    fields = plan["distribution"]["fields"]
    settings = plan["settings"]
    codes = plan["codes"]
    validation = set(plan["validation_indices"])
    n_chunks = (len(codes) + batch_size - 1) // batch_size
    done = completed_chunks(out)
    (out / CHUNKS).mkdir(parents=True, exist_ok=True)
    started, tokens, made = time.monotonic(), 0, 0
    stop = n_chunks if max_chunks is None else min(n_chunks, done + max_chunks)
    with output.progress(len(codes), "generating") as progress:
        progress.advance(min(done * batch_size, len(codes)))
        for chunk in range(done, stop):
            indices = range(chunk * batch_size, min((chunk + 1) * batch_size, len(codes)))
            strings = [code_text(fields, codes[i]) for i in indices]
            texts, lengths = generate_batch(model, tokenizer, [s + "\n" for s in strings], settings,
                                            plan["seed"] * SEED_STRIDE + chunk)
            lines = []
            for i, string, text, length in zip(indices, strings, texts, lengths):
                record = {**dict(zip(fields, codes[i])), "code": string, "text": text, "tokens": length,
                          "index": i, "split": "validation" if i in validation else "train"}
                lines.append(json.dumps(record, ensure_ascii=False) + "\n")
            atomic_write_text(out / CHUNKS / f"part-{chunk:05d}.jsonl", "".join(lines))
            tokens += sum(lengths)
            made += len(lines)
            elapsed = time.monotonic() - started
            progress.advance(len(lines), examples_per_s=made / elapsed, tokens_per_s=tokens / elapsed)
    elapsed = time.monotonic() - started
    return {"generated_now": made, "seconds": elapsed, "examples_per_second": made / elapsed if elapsed else None,
            "tokens_per_second": tokens / elapsed if elapsed else None, "complete": stop == n_chunks}


def read_chunks(out: Path) -> list[dict[str, Any]]:
    records = []
    for part in sorted((out / CHUNKS).glob("part-*.jsonl")):
        records.extend(json.loads(line) for line in read_lines(part))
    return records
