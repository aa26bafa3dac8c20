"""Red-team regressions for DP decoding (SPEC §5): settings that silently broke the stated guarantee."""

from __future__ import annotations

import copy

import pytest
import torch

from dptext.cli.app import main
from dptext.decoding import PublicSupport, dp_generate
from dptext.errors import UserError


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["decode", *args])
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def test_generation_config_cannot_multiply_the_samples_of_a_query(gpt2):
    """A model's generation_config with num_return_sequences = 3 made generate() draw 3 samples per prompt,
    while PrivateOutput still said "one ε per query": each prompt spent 3ε, and zip(prompts, texts) (the CLI
    table) paired prompt 2 with a second sample of prompt 1."""
    model, tokenizer = gpt2
    saved = model.generation_config.to_dict()
    try:
        model.generation_config.do_sample = True
        model.generation_config.num_return_sequences = 3
        out = dp_generate(model, tokenizer, ["Hi", "Yo"], lam=0.5, max_new_tokens=2, seed=0)
    finally:
        for key, value in saved.items():
            setattr(model.generation_config, key, value)
    assert len(out.texts) == len(out.token_ids) == len(out.epsilons) == 2


def test_private_model_cannot_be_its_own_public_support(gpt2):
    """ε with |V| = k needs the k tokens chosen without the private model; passing the private model
    (or a module sharing its weights) as the "public" one made its own top-k the support, unrefused."""
    model, tokenizer = gpt2
    for public in (model, copy.copy(model)):  # the same object, and a shallow copy sharing every parameter
        with pytest.raises(UserError, match="public"):
            dp_generate(model, tokenizer, "Hi", lam=0.5, max_new_tokens=2, seed=0,
                        public=PublicSupport(public, tokenizer, top_k=5))


def test_cli_refuses_the_private_model_as_public_model(capsys):
    code, _, err = run_cli(capsys, "--model", "tiny-gpt2", "--public-model", "tiny-gpt2", "--top-k", "5",
                           "--lambda", "0.5", "--prompt", "Hi", "-T", "2")
    assert code == 2 and "public" in err.lower()


def test_seedless_generation_does_not_reuse_the_global_rng(gpt2):
    """Without --seed the draws came from torch's global RNG, whose state any earlier torch.manual_seed
    (a training script, a notebook's set_seed, the fixed default seed of CUDA generators) makes known:
    the output is then a deterministic function of the private model, and the ε does not hold."""
    model, tokenizer = gpt2
    torch.manual_seed(123)
    first = dp_generate(model, tokenizer, ["Hi"] * 4, lam=0.5, max_new_tokens=5).token_ids
    torch.manual_seed(123)
    second = dp_generate(model, tokenizer, ["Hi"] * 4, lam=0.5, max_new_tokens=5).token_ids
    assert first != second
    # an explicit seed stays reproducible
    assert (dp_generate(model, tokenizer, ["Hi"] * 4, lam=0.5, max_new_tokens=5, seed=7).token_ids
            == dp_generate(model, tokenizer, ["Hi"] * 4, lam=0.5, max_new_tokens=5, seed=7).token_ids)


@pytest.mark.parametrize("max_new_tokens", [2.5, 1.5, float("nan"), float("inf")])
def test_fractional_max_new_tokens_is_refused(gpt2, max_new_tokens):
    """max_new_tokens = 2.5 let generate() sample 3 tokens while ε was reported for T = 2.5 (understated)."""
    model, tokenizer = gpt2
    with pytest.raises(UserError):
        dp_generate(model, tokenizer, "Hi", lam=0.5, max_new_tokens=max_new_tokens, seed=0)
