"""Hugging Face GPT-2's ``Conv1D``: a Linear layer that stores its weight transposed.

y_t = a_t W + b with W ∈ R^{d×p}, so the per-example weight gradient is G_i = a_iᵀ g_i: the Linear rule
with W transposed (SPEC §2). A transpose does not change a Frobenius norm, so the norms, the mixed
ghost/instantiate choice, the T = 1 case and the bias are Linear's own; only the orientation of the
instantiated gradient and of the clipped sum (aᵀ (c ⊙ g) instead of (c ⊙ g)ᵀ a) differs.
"""

from __future__ import annotations

from dptext.privacy.norms.linear import LinearRule
from dptext.privacy.norms.registry import register_rule

try:  # transformers is a dependency of dptext; keep the registry importable without it all the same
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover
    Conv1D = None


class Conv1DRule(LinearRule):
    weight_is_transposed = True


if Conv1D is not None:
    register_rule(Conv1D)(Conv1DRule)
