"""Mixture-of-experts layers (Mixtral, Qwen-MoE): refused, with the reason.

The sparse block flattens the batch to (B·T, d) tokens; the router scores every token and each expert runs on
the tokens routed to it, gathered from many examples. The rows these layers see are tokens, not examples,
and nothing in their inputs says which example a row came from, so an example's gradient cannot be separated
from the others' (and a batch-size check would pass by coincidence whenever an expert gets exactly B rows).
Until the engine has a token→example map for them, the experts and the router are refused by name; the rest
of the model (attention, norms, embeddings, LoRA on them) trains exactly with these layers frozen.
"""

from __future__ import annotations

from dptext.privacy.norms.registry import register_rule_by_name

MOE_LAYERS = {
    "mixtral": ("MixtralExperts", "MixtralTopKRouter", "MixtralSparseMoeBlock"),
    "qwen2_moe": ("Qwen2MoeExperts", "Qwen2MoeTopKRouter", "Qwen2MoeSparseMoeBlock"),

}


@register_rule_by_name(*(f"transformers.models.{family}.modeling_{family}.{name}"
                         for family, names in MOE_LAYERS.items() for name in names))
class MixtureOfExpertsRule:
    def unsupported(self, module) -> str:
        return ("its rows are tokens the router gathers from many examples, not examples, so one example's gradient "
                "cannot be separated (train attention or LoRA on it instead)")
