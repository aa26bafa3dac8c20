"""Embeddings whose output is multiplied by a constant: y_t = s · W[x_t] (Gemma 1/2/3, BART, mBART, XGLM, ...).

The per-example gradient is the plain embedding's with the output gradient scaled: G_i = Σ_t onehot(x_t) (s g_t)ᵀ,
so every form of the Embedding rule (norms, clipped sum, instantiated gradient, the outer form that a tied LM
head's cross term needs) applies to s·g. ``s`` is read from the module at each call, in the dtype its forward
uses (Gemma casts the scale to the weight's dtype first, BART multiplies by a Python float).

Hugging Face defines this layer once per model family, each time as ``super().forward(ids) * self.embed_scale``;
the classes are matched by exact qualified name, so a family whose forward adds anything (T5Gemma2 overwrites
one token's row) is not on the list and is refused.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dptext.privacy.norms.embedding import EmbeddingRule
from dptext.privacy.norms.registry import register_rule_by_name

# family: class names whose forward is exactly super().forward(ids) * self.embed_scale[.to(weight.dtype)]
SCALED_EMBEDDINGS = {
    "bart": "BartScaledWordEmbedding", "bigbird_pegasus": "BigBirdPegasusScaledWordEmbedding",
    "biogpt": "BioGptScaledWordEmbedding", "blenderbot": "BlenderbotScaledWordEmbedding",
    "diffusion_gemma": "DiffusionGemmaTextScaledWordEmbedding",
    "embedding_gemma2": "EmbeddingGemma2TextScaledWordEmbedding", "gemma": "GemmaTextScaledWordEmbedding",
    "gemma2": "Gemma2TextScaledWordEmbedding", "gemma3": "Gemma3TextScaledWordEmbedding",
    "gemma3n": "Gemma3nTextScaledWordEmbedding", "gemma4": "Gemma4TextScaledWordEmbedding",
    "m2m_100": "M2M100ScaledWordEmbedding", "mbart": "MBartScaledWordEmbedding",
    "minicpm3": "MiniCPM3ScaledWordEmbedding", "nllb_moe": "NllbMoeScaledWordEmbedding",
    "pegasus_x": "PegasusXScaledWordEmbedding", "plbart": "PLBartScaledWordEmbedding",
    "trocr": "TrOCRScaledWordEmbedding", "vaultgemma": "VaultGemmaTextScaledWordEmbedding",
    "xglm": "XGLMScaledWordEmbedding",
}


def embed_scale(module: nn.Module, like: Tensor) -> Tensor:
    scale = module.embed_scale
    if isinstance(scale, Tensor):
        scale = scale.to(module.weight.dtype)  # the rounding the forward applies
    return torch.as_tensor(scale, dtype=like.dtype, device=like.device)


@register_rule_by_name(*(f"transformers.models.{family}.modeling_{family}.{name}"
                         for family, name in SCALED_EMBEDDINGS.items()))
class ScaledEmbeddingRule(EmbeddingRule):
    def norm_sq(self, module, names, ids, grad_output):
        return super().norm_sq(module, names, ids, grad_output * embed_scale(module, grad_output))

    def add_clipped_sum(self, total, module, ids, grad_output, coef):
        return super().add_clipped_sum(total, module, ids, grad_output * embed_scale(module, grad_output), coef)

    def per_example(self, module, names, ids, grad_output):
        return super().per_example(module, names, ids, grad_output * embed_scale(module, grad_output))

    def outer_form(self, module, names, ids, grad_output):
        return super().outer_form(module, names, ids, grad_output * embed_scale(module, grad_output))
