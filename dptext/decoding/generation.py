"""Private text generation (causal LMs) and mask filling (masked LMs) with the λ-perturbed sampler.

Each prompt is one query; its ε covers up to T sampled tokens: ``max_new_tokens`` for
generation (stopping early at EOS only samples fewer), the number of mask tokens for mask
filling. Greedy and beam search pick tokens deterministically from q', which the theorem does
not cover, so only random sampling is offered and every other decoding setting is refused.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from dptext.decoding.mechanism import check_lambda, epsilon_for_lambda, perturbed_log_probs
from dptext.decoding.processor import DPSamplingLogitsProcessor, check_temperature
from dptext.decoding.public_support import (
    PublicTopKDPLogitsProcessor,
    check_public_is_independent,
    check_shared_vocabulary,
    output_vocab_size,
)
from dptext.decoding.sampling_rules import SAFE_GENERATE_ARGS, refuse_unsafe_decoding
from dptext.errors import UserError


@dataclass(frozen=True)
class PrivateOutput:
    """Outputs of one batch of queries and the privacy each one cost."""

    texts: list[str]
    token_ids: list[list[int]]  # the sampled tokens of each query (after EOS: padding)
    lam: float
    support_size: int  # |V| in ε: the output dimension, or k with a public support
    tokens: list[int]  # T per query: the bound on sampled tokens that ε is computed for
    epsilons: list[float]


@dataclass(frozen=True)
class PublicSupport:
    """A public model (and its tokenizer) whose top-k tokens form the sampling support."""

    model: object
    tokenizer: object
    top_k: int


def _fork_rng(device: torch.device):
    devices = [device] if device.type == "cuda" else []
    return torch.random.fork_rng(devices=devices)


def _secret_seed() -> int:
    """A seed from the operating system: without --seed the draws must be unknown to the reader, which the
    global torch RNG is not (any earlier torch.manual_seed, or the fixed default seed of CUDA generators)."""
    return int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)


@torch.no_grad()
def dp_generate(model, tokenizer, prompts: str | list[str], lam: float, max_new_tokens: int,
                temperature: float = 1.0, seed: int | None = None, public: PublicSupport | None = None,
                **generate_args) -> PrivateOutput:
    """Sample continuations of ``prompts`` from q' with ``model.generate`` and check that it did.

    ``temperature`` is applied to q before the mixing (it does not change ε). A fixed ``seed``
    makes outputs reproducible; the guarantee assumes the sampling randomness is unknown to
    whoever reads the output, so a service must not expose or reuse seeds.
    """
    refuse_unsafe_decoding(generate_args)
    if "temperature" in generate_args:  # moved before the mixing, where it does not change ε
        temperature = generate_args.pop("temperature")
    # what is left of the sampling settings is neutral (checked above); ours replace them
    generate_args = {k: v for k, v in generate_args.items() if k in SAFE_GENERATE_ARGS}
    # generate() stops at the first length ≥ prompt + max_new_tokens, so a fractional value samples
    # ceil(T) tokens while ε would be computed for T: only whole numbers ≥ 1 are accepted
    if not (math.isfinite(max_new_tokens) and max_new_tokens == int(max_new_tokens) and max_new_tokens >= 1):
        raise UserError(f"--max-new-tokens must be a whole number ≥ 1, got {max_new_tokens}.")
    max_new_tokens = int(max_new_tokens)
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    device = next(model.parameters()).device
    # decoder-only batches must end where generation starts
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left").to(device)
    vocab_size = output_vocab_size(model)
    if public is None:
        processor = DPSamplingLogitsProcessor(lam, vocab_size, check_temperature(temperature), keep_outputs=True)
    else:
        check_public_is_independent(model, public.model)
        check_shared_vocabulary(model, tokenizer, public.model, public.tokenizer)
        processor = PublicTopKDPLogitsProcessor(lam, vocab_size, public.model, public.top_k,
                                                check_temperature(temperature), batch["attention_mask"],
                                                keep_outputs=True)
    user_processors = list(generate_args.pop("logits_processor", None) or [])
    generate_args.setdefault("pad_token_id", tokenizer.pad_token_id)
    with _fork_rng(device):
        torch.manual_seed(seed if seed is not None else _secret_seed())
        result = model.generate(**batch, max_new_tokens=max_new_tokens, logits_processor=user_processors + [processor],
                                return_dict_in_generate=True, output_scores=True,
                                **processor.generate_kwargs(), **generate_args)
    processor.verify(result.scores)
    new_tokens = result.sequences[:, batch["input_ids"].shape[1]:]
    texts = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    epsilon = processor.epsilon(max_new_tokens)
    return PrivateOutput(texts, new_tokens.tolist(), processor.lam, processor.support_size(),
                         [max_new_tokens] * len(texts), [epsilon] * len(texts))


@torch.no_grad()
def dp_fill_masks(model, tokenizer, texts: str | list[str], lam: float, temperature: float = 1.0,
                  seed: int | None = None) -> PrivateOutput:
    """Replace every mask token of each text by a token sampled from q' (one forward pass).

    The masks of one text are one query: ε uses T = its number of masks (Majmudar et al. §2).
    """
    lam = check_lambda(lam)
    texts = [texts] if isinstance(texts, str) else list(texts)
    temperature = check_temperature(temperature)
    mask_id = tokenizer.mask_token_id
    if mask_id is None:
        raise UserError("This tokenizer has no mask token, so there is nothing to fill; use a masked LM.")
    device = next(model.parameters()).device
    batch = tokenizer(texts, return_tensors="pt", padding=True).to(device)
    is_mask = batch["input_ids"] == mask_id
    counts = is_mask.sum(dim=1).tolist()
    if min(counts) == 0:
        raise UserError(f"Every prompt needs at least one {tokenizer.mask_token} to fill, e.g. "
                        f"'The {tokenizer.mask_token} sat on the mat.'")
    logits = model(**batch).logits[is_mask]
    vocab_size = logits.shape[-1]  # |V| = the output dimension, as in generation
    log_q_prime = perturbed_log_probs(logits / temperature, lam)
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    sampled = torch.multinomial(log_q_prime.exp(), 1, generator=generator).squeeze(-1)
    filled = batch["input_ids"].clone()
    filled[is_mask] = sampled
    out_texts = tokenizer.batch_decode(filled, skip_special_tokens=True)
    per_text = [row[row_is_mask].tolist() for row, row_is_mask in zip(filled, is_mask)]
    return PrivateOutput(out_texts, per_text, lam, vocab_size, counts,
                         [epsilon_for_lambda(lam, vocab_size, c) for c in counts])
