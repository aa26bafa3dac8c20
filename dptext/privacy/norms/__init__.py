"""Per-layer rules for per-example gradient norms and clipped sums, one module per layer type (SPEC §2).

Importing this package registers every rule; ``find_rule(module)`` looks one up.
"""

from dptext.privacy.norms import conv1d, embedding, layernorm, linear, rmsnorm  # noqa: F401  (registers)
from dptext.privacy.norms.outer import OuterForm, inner_product
from dptext.privacy.norms.registry import RULES, find_rule, register_rule

__all__ = ["RULES", "OuterForm", "find_rule", "inner_product", "register_rule"]
