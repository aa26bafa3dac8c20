"""The ``audit`` section of a recipe: the member/non-member split, public pool and canaries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from dptext.config.fields import doc


@dataclass
class AuditConfig:
    """Bookkeeping for `dptext mia` (SPEC §7). Everything here is drawn before training, seeded, and written to
    the run's ``audit/`` folder; held-out records shrink the training set n, and q, δ = 1/(2n) follow the n
    actually trained on."""

    holdout_fraction: float = doc(0.0, "Fraction of the training split held out, untrained, as the non-member set "
                                  "of membership inference (same distribution as the members).", ge=0, lt=1)
    holdout_examples: Optional[int] = doc(
        None, "Hold out exactly this many non-members (overrides holdout_fraction).", ge=1)
    public_examples: int = doc(0, "Also set aside this many training records, trained on by neither the run nor "
                               "its non-members: the 'public' pool shadow and reference models train on.", ge=0)
    seed: int = doc(0, "Seed of the member / non-member / public partition and of the canaries.", ge=0)
    train_indices: list = doc([], "Train only on these indices of the training split (written by `dptext mia` "
                              "for its shadow/reference models; empty = all).")
    canaries: int = doc(
        0, "Canaries per repetition count inserted into the training data (language-model tasks).", ge=0)
    canary_repetitions: list = doc([1, 10], "How many times each canary is repeated, one group of `canaries` "
                                   "canaries per entry.")
    one_run_canaries: int = doc(
        0, "m canaries for the one-run audit (`dptext mia --attack one-run`, Steinke et al. 2023): each is included "
        "in training once, independently with probability 1/2 by a public coin seeded with audit.seed, before "
        "training (language-model tasks).", ge=0)
    canary_prefix: str = doc("the secret code is", "Fixed prefix of every canary; the secret follows it.")
    canary_words: int = doc(4, "Random words in each canary's secret.", ge=1)
    canary_vocabulary: int = doc(100, "Size of the word list secrets are drawn from: |R| = vocabulary ** words.", ge=2)
    canary_unit: Literal["example", "user"] = doc(
        "example", "Whose are a canary's copies: example = each copy is its own (synthetic) user; user = all copies "
        "of one canary belong to one synthetic user, a person repeating a secret, which privacy.unit=user protects "
        "as one unit and example-level DP only through group privacy (`dptext mia canary --compare-units`).")
