"""Overhead of DP decoding against plain sampling, measured side by side in one process.

    python -m dptext.decoding.benchmark --model smollm2-135m --new-tokens 64 --repeats 7

Both arms sample the same number of tokens (EOS is suppressed in both) with the same settings
(full vocabulary, temperature 1, no top-k/top-p); the DP arm is ``dp_generate`` as users call
it, including the perturbation and the after-the-fact check of the sampled-from scores. Runs
alternate (plain, DP, plain, ...) so drifting machine load hits both; medians and best-of-N are
reported, and the perturbation alone is timed per step to give its share of a generation.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from dptext.decoding.generation import dp_generate
from dptext.decoding.loading import load_for_decoding
from dptext.decoding.processor import DPSamplingLogitsProcessor
from dptext.decoding.public_support import output_vocab_size
from dptext.decoding.sampling_rules import PLAIN_SAMPLING_SETTINGS

PROMPT = "The restaurant near the river serves"


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def processor_seconds_per_step(vocab_size: int, batch_size: int = 1, lam: float = 0.8, calls: int = 200,
                               device: str = "cpu") -> float:
    """The perturbation alone: one processor call on a (batch, |V|) score tensor, median of ``calls``."""
    processor = DPSamplingLogitsProcessor(lam, vocab_size)
    scores = torch.randn(batch_size, vocab_size, device=device)
    input_ids = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
    return statistics.median(_timed(lambda: processor(input_ids, scores)) for _ in range(calls))


def benchmark_overhead(model, tokenizer, new_tokens: int = 64, repeats: int = 7, lam: float = 0.8,
                       batch_size: int = 1, prompt: str = PROMPT) -> dict:
    """Median seconds per generation for plain sampling and DP sampling, and their ratio."""
    prompts = [prompt] * batch_size
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left").to(model.device)
    same_length = {"min_new_tokens": new_tokens, "pad_token_id": tokenizer.pad_token_id}

    def plain():
        model.generate(**batch, max_new_tokens=new_tokens, **PLAIN_SAMPLING_SETTINGS, **same_length)

    def private():
        dp_generate(model, tokenizer, prompts, lam, new_tokens, **same_length)

    plain(), private()  # warm-up: first calls allocate caches
    plain_times, private_times = [], []
    for _ in range(repeats):
        plain_times.append(_timed(plain))
        private_times.append(_timed(private))
    plain_median, private_median = statistics.median(plain_times), statistics.median(private_times)
    per_step = processor_seconds_per_step(output_vocab_size(model), batch_size, lam, device=str(model.device))
    return {"new_tokens": new_tokens, "batch_size": batch_size, "repeats": repeats, "lambda": lam,
            "plain_s": plain_median, "dp_s": private_median, "overhead": private_median / plain_median - 1.0,
            # on a shared machine noise only adds time, so the fastest run is the steadiest estimate
            "overhead_best_of": min(private_times) / min(plain_times) - 1.0,
            "processor_s_per_step": per_step, "processor_share": per_step * new_tokens / plain_median,
            "plain_runs_s": plain_times, "dp_runs_s": private_times, "device": str(model.device),
            "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (1 avoids spin-wait thrashing on a busy shared machine)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, _ = load_for_decoding(args.model, args.device)
    result = benchmark_overhead(model, tokenizer, args.new_tokens, args.repeats, batch_size=args.batch_size)
    print(json.dumps({"model": args.model, **result}, indent=2))


if __name__ == "__main__":
    main()
