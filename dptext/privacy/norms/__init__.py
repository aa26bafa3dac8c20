"""Per-layer rules for per-example gradient norms and clipped sums, one module per layer type (SPEC §2).

Importing this package registers every rule; ``find_rule(module)`` looks one up.
"""

from dptext.privacy.norms import (  # noqa: F401  (importing a rule file registers its rules)
    cohere_layernorm, conv1d, deberta_relative, dora, embedding, layernorm, linear, moe, multihead_attention,
    positional_embedding, relative_bias, rmsnorm, row_layouts, scaled_embedding)
from dptext.privacy.norms.outer import OuterForm, inner_product
from dptext.privacy.norms.registry import MODEL_PATCHES, RULES, find_child_rules, find_rule, register_rule

__all__ = ["MODEL_PATCHES", "RULES", "OuterForm", "find_child_rules", "find_rule", "inner_product", "register_rule"]
