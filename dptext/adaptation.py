"""Which parameters a fine-tuning run trains: the rows of Li et al. Table 2.

* ``full``: every parameter (the paper's recommendation under DP);
* ``lora``: low-rank adapters on the attention and MLP projections (peft), base frozen;
* ``bias``: only bias terms (BitFit), plus a task head the model adds;
* ``top_n``: the last N transformer blocks, the final norm and the head;
* ``retrain``: every parameter, from a random initialisation (``load_model(random_init=True)``).
A newly added classification head is always trained, whatever the method.
"""

from __future__ import annotations

import re
from typing import Any

from dptext.errors import UserError

HEAD_NAMES = ("classifier", "score", "pooler")  # heads a *ForSequenceClassification adds
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",  # Llama
                "c_attn", "c_proj", "c_fc",  # GPT-2
                "query", "key", "value", "dense")  # BERT / RoBERTa


def _is_head(name: str) -> bool:
    return any(part in HEAD_NAMES for part in name.split("."))


def _layer_index(name: str) -> int | None:
    match = re.search(r"\.(?:h|layers|layer)\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def apply_adaptation(model: Any, recipe: Any) -> Any:
    """Freeze what the method does not train; returns the model (wrapped by peft for LoRA)."""
    method = recipe.model.adaptation
    if method in ("full", "retrain"):
        return model
    if method == "lora":
        return _apply_lora(model, recipe)
    names = [name for name, _ in model.named_parameters()]
    if method == "bias":
        keep = {n for n in names if n.endswith(".bias") or _is_head(n)}
    elif method == "top_n":
        layers = [i for i in map(_layer_index, names) if i is not None]
        if not layers:
            raise UserError("adaptation=top_n could not find numbered transformer layers in this model; "
                            "use full, lora or bias.")
        first = max(layers) + 1 - recipe.model.top_n_layers
        keep = {n for n in names if (_layer_index(n) is not None and _layer_index(n) >= first)
                or (_layer_index(n) is None and not _is_embedding(n)) or _is_head(n)}
    else:  # pragma: no cover - the schema's Literal rejects anything else
        raise UserError(f"Unknown adaptation '{method}'.")
    for name, param in model.named_parameters():  # only ever freezes: a part the model froze stays frozen
        param.requires_grad_(param.requires_grad and name in keep)
    if not any(p.requires_grad for p in model.parameters()):
        raise UserError(f"adaptation={method} left nothing to train in this model; choose another method.")
    return model


def _is_embedding(name: str) -> bool:
    # Tied LM heads share the input embedding, so top_n keeps it frozen along with positions.
    return any(key in name for key in ("embed", "wte", "wpe", "lm_head", "decoder", "shared"))


def _apply_lora(model: Any, recipe: Any) -> Any:
    try:
        from peft import LoraConfig, get_peft_model  # optional dependency: only LoRA runs need peft
    except ImportError as exc:
        raise UserError("adaptation=lora needs peft; run `pip install peft` (or `pip install dptext[peft]`).") from exc
    present = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()}
    targets = [t for t in LORA_TARGETS if t in present]
    if not targets:
        raise UserError("adaptation=lora found none of the usual projection layers in this model; use full or bias.")
    config = LoraConfig(r=recipe.model.lora_rank, lora_alpha=recipe.model.lora_alpha, target_modules=targets,
                        lora_dropout=0.0, bias="none", modules_to_save=[h for h in HEAD_NAMES if h in present])
    return get_peft_model(model, config)


def trainable_summary(model: Any) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"parameters": total, "trainable_parameters": trainable}
