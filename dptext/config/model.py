"""The ``model`` section of a recipe: which model and which parameters train."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dptext.config.fields import doc


@dataclass
class ModelConfig:
    name: str = doc("smollm2-135m", "Hub name (gpt2, roberta-base), local folder, or offline alias "
                    "(smollm2-135m, minilm-l6, tiny-gpt2, tiny-llama, tiny-bert, tiny-roberta; clc, tiny-clc: "
                    "the bi-LSTM of task.type=intent_slot).")
    adaptation: Literal["full", "lora", "bias", "top_n", "retrain"] = doc(
        "full", "Which parameters train: all (full), LoRA adapters, biases only, the top N layers, or all from a "
        "random initialisation (retrain), as in Li et al. Table 2.")
    lora_rank: int = doc(8, "LoRA rank r (adaptation=lora).", ge=1)
    lora_alpha: float = doc(16.0, "LoRA scaling alpha (adaptation=lora).", gt=0)
    top_n_layers: int = doc(2, "Number of top transformer layers to train (adaptation=top_n; 0: only the head).", ge=0)
    untie_embeddings: bool = doc(False, "Give the LM head its own copy of the input embedding. Off by default: "
                                 "dptext clips tied weights exactly.")
