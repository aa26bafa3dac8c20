"""``load_tokenizer`` and ``load_model``: every model name (hub, folder, offline alias, tiny) to a model with a head."""

from __future__ import annotations

import pickle
import time
from typing import Any

from dptext.errors import UserError
from dptext.models.offline import CLC_MODELS, OFFLINE_MODELS, TINY_MODELS, _quiet_transformers, model_source
from dptext.models.tiny import TINY_SEED, tiny_config, tiny_tokenizer
from dptext.models.word_tokenizer import WordTokenizer

HEADS = ("causal_lm", "masked_lm", "sequence_classification", "token_classification", "base")



def _auto_class(head: str):
    import transformers  # transformers loads in seconds; importing dptext.models stays light for `dptext check`

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



def load_tokenizer(name: str):
    """The tokenizer of ``name``, with a pad token set (GPT-2 style models have none)."""
    _quiet_transformers()
    if name in CLC_MODELS:  # fixed public word and character vocabularies (never the training split's)
        return WordTokenizer.public(load_tokenizer("minilm-l6").get_vocab())
    if name in TINY_MODELS:
        return tiny_tokenizer(name)
    # transformers loads in seconds; importing dptext.models stays light for `dptext check`
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
    import torch  # lazily, like transformers: importing dptext.models stays light for `dptext check`

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
            # transformers loads in seconds; importing dptext.models stays light for `dptext check`
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
    except Exception as exc:
        if _damaged_weights(exc):
            raise UserError(f"Model '{name}': its weights file is damaged or incomplete ({exc}); copy or save the "
                            "model folder again (a run's model/ is rewritten by `dptext finetune --resume`).") from exc
        raise
    if head == "masked_lm" and _missing_mlm_head(info.get("missing_keys", [])):
        raise UserError(f"Model '{name}' has no pretrained masked-LM head (its predictions would come from a "
                        "random layer); use a model with one, such as roberta-base or bert-base-uncased "
                        "(for fine-tuning, task.type=classification works with any encoder).")
    return model.eval(), tokenizer


def _damaged_weights(exc: BaseException) -> bool:
    """A weights file cut short or overwritten: safetensors' header error, or torch's unpickler / zip reader."""
    text = str(exc)
    return (type(exc).__name__ == "SafetensorError" or isinstance(exc, (EOFError, pickle.UnpicklingError))
            or isinstance(exc, RuntimeError) and ("PytorchStreamReader" in text or "zip archive" in text))


def _missing_mlm_head(missing_keys: list[str]) -> bool:
    # The decoder weight is tied to the input embedding and may be reported missing
    # legitimately; the transform / dense layers of the head may not.
    return any(("predictions" in k or "lm_head" in k) and "decoder" not in k for k in missing_keys)


def _not_found(name: str) -> UserError:
    return UserError(
        f"Could not load model '{name}' from the Hugging Face hub or a local folder (no network, or a misspelt "
        f"name); pass a local folder or an offline alias ({', '.join(list(OFFLINE_MODELS) + list(TINY_MODELS))}).")


def smoke_test(name: str) -> dict[str, Any]:
    """Load ``name`` with its natural head and run one forward pass on a short sentence."""
    import torch  # torch and transformers load lazily: `dptext check` and `dptext models` list names without them

    start = time.monotonic()
    is_encoder = name in ("minilm-l6", "tiny-bert", "tiny-roberta")
    head = "base" if name == "minilm-l6" else ("masked_lm" if is_encoder else "causal_lm")
    model, tokenizer = load_model(name, head=head)
    batch = tokenizer(["Differential privacy protects each training example."], return_tensors="pt")
    with torch.no_grad():
        model(**batch)
    return {"name": name, "class": type(model).__name__, "head": head,
            "parameters": sum(p.numel() for p in model.parameters()), "seconds": time.monotonic() - start}
