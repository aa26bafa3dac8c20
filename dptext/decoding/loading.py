"""Load a model for DP decoding and tell whether it predicts next tokens or masked tokens."""

from __future__ import annotations

import torch

from dptext import models
from dptext.errors import UserError
from dptext.models import load_model

CAUSAL, MASKED = "causal_lm", "masked_lm"


def _config_of(name: str):
    if name in models.TINY_MODELS:
        return models.tiny_config(name, len(models.load_tokenizer(name)))
    from transformers import AutoConfig  # transformers loads in seconds; only the model's own loading needs it

    try:
        return AutoConfig.from_pretrained(models.model_source(name))
    except OSError as exc:
        raise UserError(f"Could not load model '{name}' (no network, or a misspelt name); pass a local folder, "
                        "a hub name or an offline alias such as smollm2-135m.") from exc


def model_kind(name: str) -> str:
    """``causal_lm`` or ``masked_lm``: what DP decoding with ``name`` means (generation or mask filling)."""
    import transformers  # transformers loads in seconds; only the model's own loading needs it

    config = _config_of(name)
    if getattr(config, "is_encoder_decoder", False):
        raise UserError(f"'{name}' is an encoder-decoder model; DP decoding supports causal LMs (generation) "
                        "and masked LMs (mask filling).")
    for architecture in getattr(config, "architectures", None) or []:
        if architecture.endswith("ForMaskedLM"):
            return MASKED
        if architecture.endswith(("ForCausalLM", "LMHeadModel")):
            return CAUSAL
    # BERT-style configs are listed for both heads; an encoder (not is_decoder) means masked LM.
    masked = type(config) in transformers.MODEL_FOR_MASKED_LM_MAPPING
    causal = type(config) in transformers.MODEL_FOR_CAUSAL_LM_MAPPING
    if masked and not (causal and getattr(config, "is_decoder", False)):
        return MASKED
    if causal:
        return CAUSAL
    raise UserError(f"'{name}' ({config.model_type}) is neither a causal nor a masked language model, so it has "
                    "no token distribution to decode from; pick e.g. smollm2-135m or roberta-base.")


def load_for_decoding(name: str, device: str = "auto"):
    """``(model, tokenizer, kind)`` on ``device`` (``auto``: the GPU when there is one)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device} was requested but no CUDA GPU is visible; use --device cpu.")
    kind = model_kind(name)
    model, tokenizer = load_model(name, head=kind)
    return model.to(device).eval(), tokenizer, kind
