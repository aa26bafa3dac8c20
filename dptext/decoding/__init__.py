"""Differentially private decoding (Majmudar et al.; SPEC §5).

The numerics (``mechanism``) import nothing heavy; the model-facing parts import torch and
transformers on first use, so ``from dptext.decoding import epsilon_for_lambda`` stays cheap.

    from dptext.decoding import dp_generate, lambda_for_epsilon
    out = dp_generate(model, tokenizer, "The weather today", lam=0.8, max_new_tokens=20)
    out.texts[0], out.epsilons[0]
"""

from __future__ import annotations

import importlib

from dptext.decoding.mechanism import (
    check_lambda,
    epsilon_for_lambda,
    epsilon_per_token,
    lambda_for_epsilon,
    perturbed_log_prob_of_targets,
    perturbed_log_probs,
)

_LAZY = {
    "DPSamplingLogitsProcessor": "processor",
    "PrivacyViolation": "processor",
    "PublicTopKDPLogitsProcessor": "public_support",
    "check_public_is_independent": "public_support",
    "check_shared_vocabulary": "public_support",
    "output_vocab_size": "public_support",
    "PrivateOutput": "generation",
    "PublicSupport": "generation",
    "dp_generate": "generation",
    "dp_fill_masks": "generation",
    "refuse_unsafe_decoding": "sampling_rules",
    "SweepResult": "sweep",
    "read_texts": "sweep",
    "parse_lambdas": "sweep",
    "perplexity_sweep": "sweep",
    "plot_sweep": "plot",
}

__all__ = ["check_lambda", "epsilon_for_lambda", "epsilon_per_token", "lambda_for_epsilon",
           "perturbed_log_prob_of_targets", "perturbed_log_probs", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'dptext.decoding' has no attribute '{name}'")
    return getattr(importlib.import_module(f"dptext.decoding.{_LAZY[name]}"), name)
