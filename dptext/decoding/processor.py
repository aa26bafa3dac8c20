"""The λ-perturbed sampler as a Hugging Face ``LogitsProcessor``.

Where it sits matters. In transformers 5, ``generate`` runs its built-in processors, then the
ones passed in ``logits_processor=``, then the sampling warpers (temperature, top-k, top-p,
min-p, typical, ε/η cutoffs, top-h), watermarking and ``renormalize_logits``, and finally
samples. A warper after the mixing rescales or truncates q', which voids the guarantee —
and top-k = 50 is applied by default unless ``top_k=0`` is passed. So this processor takes
the temperature itself (before mixing, where it is harmless), ``generate_kwargs()`` gives the
settings that switch every later step off, and ``verify(scores)`` checks afterwards that what
was sampled from is exactly what this processor emitted. ``dptext.decoding.dp_generate``
does all three; use the class directly only if you need your own ``generate`` call.
"""

from __future__ import annotations

import math

import torch
from transformers import LogitsProcessor

from dptext.decoding.mechanism import check_lambda, epsilon_for_lambda, perturbed_log_probs
from dptext.decoding.sampling_rules import PLAIN_SAMPLING_SETTINGS
from dptext.errors import UserError

class PrivacyViolation(RuntimeError):
    """The tokens were not sampled from the perturbed distribution: the result must be discarded."""


def check_temperature(temperature: float) -> float:
    temperature = float(temperature)
    if not (math.isfinite(temperature) and temperature > 0):
        raise UserError(f"The temperature must be a finite number > 0, got {temperature}; 1.0 leaves q unchanged.")
    return temperature


class DPSamplingLogitsProcessor(LogitsProcessor):
    """Replace next-token scores by log q', q' = λ·softmax(z / temperature) + (1 − λ)·uniform.

    ``vocab_size`` is the |V| that ε is computed with: the model's output dimension (the size
    of the logits), not ``len(tokenizer)``. Sampling happens over every logit, including ids the
    tokenizer never produces (padded embedding rows), so each of them needs the uniform mass and
    each of them counts in |V|. A call with a different logits size raises.
    """

    def __init__(self, lam: float, vocab_size: int, temperature: float = 1.0, keep_outputs: bool = False):
        self.lam = check_lambda(lam)
        self.vocab_size = int(vocab_size)
        self.temperature = check_temperature(temperature)
        self.keep_outputs = keep_outputs
        self.emitted: list[torch.Tensor] = []

    def support(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor | None:
        """The allowed tokens per row, or None for the whole vocabulary (subclasses restrict it)."""
        return None

    def support_size(self) -> int:
        return self.vocab_size

    def epsilon(self, tokens: int) -> float:
        """ε of one query that samples at most ``tokens`` tokens through this processor."""
        return epsilon_for_lambda(self.lam, self.support_size(), tokens)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[-1] != self.vocab_size:
            raise PrivacyViolation(f"The model produced {scores.shape[-1]} logits but ε was computed for "
                                   f"|V| = {self.vocab_size}; pass the model's output dimension as vocab_size.")
        log_q_prime = perturbed_log_probs(scores / self.temperature, self.lam, self.support(input_ids, scores))
        if self.keep_outputs:
            self.emitted.append(log_q_prime.detach().clone())
        return log_q_prime

    @staticmethod
    def generate_kwargs() -> dict:
        """The ``generate`` settings under which nothing runs after this processor but sampling."""
        return dict(PLAIN_SAMPLING_SETTINGS)

    def verify(self, sampled_from: tuple[torch.Tensor, ...]) -> None:
        """Check ``generate(..., output_scores=True).scores`` against what this processor emitted.

        Exact equality: any later warper (a forgotten top-k, a second temperature) changes
        the scores, and then the tokens came from a distribution the ε does not cover.
        """
        if not self.keep_outputs:
            raise ValueError("Construct the processor with keep_outputs=True to verify its outputs.")
        if len(sampled_from) != len(self.emitted):
            raise PrivacyViolation(f"generate sampled {len(sampled_from)} steps but the DP processor ran "
                                   f"{len(self.emitted)} times; discard this output.")
        for step, (final, ours) in enumerate(zip(sampled_from, self.emitted)):
            if final.shape != ours.shape or not torch.equal(final.to(ours.dtype), ours):
                raise PrivacyViolation(
                    f"At step {step} generate changed the scores after the DP processor (a top-k/top-p/"
                    "temperature warper or similar ran after it), so the tokens were not sampled from q'; "
                    "discard this output and pass processor.generate_kwargs() to generate.")
