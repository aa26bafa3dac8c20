"""Record -> text -> tokens: prompts carry no loss, completions end in EOS, padding is masked."""

from __future__ import annotations

import torch

from dptext.models import load_tokenizer
from dptext.tasks import text_format
from dptext.tasks.encoding import IGNORE_INDEX, encode_prompt_completion, pad_batch


def test_table_prompts_for_e2e_and_dart():
    assert text_format.table_prompt({"mr": "name[X], food[Thai]"}) == "name[X], food[Thai]\nDescription:"
    dart = {"tripleset": [["Mars Hill College", "JOINED", "1973"], ["Mars Hill College", "LOCATION", "NC"]]}
    assert text_format.table_source(dart) == "Mars Hill College : JOINED : 1973 | Mars Hill College : LOCATION : NC"


def test_control_code_and_dialog_prompt():
    assert text_format.control_code({"category": "books", "rating": 4}, ["category", "rating"]) == \
        "Category: books || Rating: 4"
    prompt = text_format.dialog_prompt({"history": ["hi", "hello, how are you?"], "response": "fine"})
    assert prompt == "hi\nhello, how are you?\nReply:"


def test_loss_only_on_completion_and_eos():
    tokenizer = load_tokenizer("tiny-gpt2")
    example = encode_prompt_completion(tokenizer, "abc\nDescription:", " xyz", max_length=64)
    prompt_len = len(tokenizer("abc\nDescription:", add_special_tokens=False)["input_ids"])
    assert example.labels[:prompt_len] == [IGNORE_INDEX] * prompt_len
    assert example.labels[prompt_len:] == example.input_ids[prompt_len:]
    assert example.input_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(example.labels[prompt_len:-1]) == " xyz"


def test_truncation_keeps_the_prompt_end_and_completion_start():
    tokenizer = load_tokenizer("tiny-gpt2")
    example = encode_prompt_completion(tokenizer, "p" * 100 + "CUE", "c" * 100, max_length=40)
    assert len(example.input_ids) == 40
    supervised = [t for t in example.labels if t != IGNORE_INDEX]
    assert tokenizer.decode(supervised).startswith("c")
    assert tokenizer.decode(example.input_ids[:20]).endswith("CUE")


def test_padding_is_masked_on_either_side():
    tokenizer = load_tokenizer("tiny-gpt2")
    short = encode_prompt_completion(tokenizer, "a:", " b", 32)
    long = encode_prompt_completion(tokenizer, "a longer prompt:", " and completion", 32)
    for side in ("right", "left"):
        batch = pad_batch([short, long], tokenizer.pad_token_id, padding_side=side)
        assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
        assert batch["attention_mask"][0].sum() == len(short.input_ids)
        padded = batch["attention_mask"] == 0
        assert torch.all(batch["labels"][padded] == IGNORE_INDEX)
        assert torch.all(batch["input_ids"][padded] == tokenizer.pad_token_id)
