"""Tiny randomly initialised test models built in code: byte-level tokenizer and small configs, no network."""

from __future__ import annotations

from typing import Any

from dptext.errors import UserError
from dptext.models.offline import TINY_MODELS

TINY_HIDDEN = 32
TINY_LAYERS = 2
TINY_MAX_POSITIONS = 512
TINY_SEED = 0

_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<mask>"]


def tiny_tokenizer(name: str):
    """A byte-level BPE tokenizer with no merges: covers any text, built without network."""
    # transformers/tokenizers load in seconds; importing dptext.models stays light
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
    # transformers/tokenizers load in seconds; importing dptext.models stays light
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
