"""FSDP2 runs load a Hugging Face folder without any rank holding all of it (``dptext.finetune.meta_load``): 2 gloo
processes.

Tiny folders of several architectures are saved with ``save_pretrained`` (a Llama with tied embeddings, GPT-2 stored
in bf16, a BERT masked-LM checkpoint loaded with a new classification head, a RoBERTa base checkpoint without the
prefix loaded with a classification head, an untied Qwen2 in a sharded index). Each is loaded by the meta path and
by today's path (the whole model on every rank, then sharded): every parameter's gathered value and every buffer
are the same bit for bit, ties stay tied, and no rank allocated a tensor as large as the largest parameter nor read
more than its own rows of the file on the meta path (today's path allocates whole fp32 parameters from the bf16
file, which shows the check can fail; fp32 files it maps whole instead).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from two_ranks import run_two_ranks

TIMEOUT = 300
VOCAB = 250
ARCHS = {  # name -> (config class, saved class, head to load, num_labels, stored dtype, max shard size)
    "llama": ("LlamaConfig", "LlamaForCausalLM", "causal_lm", None, torch.float32, None),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", "causal_lm", None, torch.bfloat16, None),
    "bert": ("BertConfig", "BertForMaskedLM", "sequence_classification", 3, torch.float32, None),
    "roberta": ("RobertaConfig", "RobertaModel", "sequence_classification", 2, torch.float32, None),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "causal_lm", None, torch.float32, "20KB"),
}


def tiny_config(arch: str):
    import transformers

    common = {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    sizes = {"gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64},
             "llama": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "tie_word_embeddings": True},
             "qwen2": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "tie_word_embeddings": False}}
    encoder = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
               "max_position_embeddings": 66}
    return getattr(transformers, ARCHS[arch][0])(**common, **sizes.get(arch, encoder))


def save_folder(arch: str, folder: Path) -> None:
    import transformers

    from dptext.models.tiny import tiny_tokenizer

    _, saved, _, _, dtype, shard = ARCHS[arch]
    torch.manual_seed(1)
    model = getattr(transformers, saved)(tiny_config(arch)).to(dtype)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    tiny_tokenizer("tiny-llama").save_pretrained(folder)  # load_model loads the folder's tokenizer too


def recipe():
    return SimpleNamespace(model=SimpleNamespace(adaptation="full"), train=SimpleNamespace(precision="fp32"))


class Created(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest real (not meta) storage, in elements of its tensor, that any operation allocated; a view of
    storage it was given (safetensors' memory map of the file, a slice) is not an allocation."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {_storage(x) for x in torch.utils._pytree.tree_leaves((args, kwargs))}
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and _storage(tensor) not in given | {None}:
                self.largest = max(self.largest, tensor.untyped_storage().nbytes() // tensor.element_size())
        return out


def _storage(value) -> int | None:
    """Where a tensor's (or storage's) memory starts; None for meta tensors and wrappers without storage (DTensor)."""
    try:
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            return value.untyped_storage().data_ptr()
        return value.data_ptr() if isinstance(value, torch.UntypedStorage) else None
    except RuntimeError:
        return None


READ: list = []  # elements read from the files by the meta path, one entry per read


def count_reads() -> None:
    """Wrap the meta path's readers (once per process) to count what each rank reads."""
    from dptext.finetune.shard_fill import _Readers

    real_rows, real_whole = _Readers.rows, _Readers.whole

    def rows(self, key, first, count):
        out = real_rows(self, key, first, count)
        READ.append(out.numel())
        return out

    def whole(self, key):
        out = real_whole(self, key)
        READ.append(out.numel())
        return out

    _Readers.rows, _Readers.whole = rows, whole


def loaded(arch: str, folder: Path, ctx, meta: bool):
    """(model, largest tensor created, elements read from the file) on this rank."""
    from dptext.finetune.meta_load import meta_loaded
    from dptext.finetune.sharding import shard_model
    from dptext.models.loading import load_model

    _, _, head, labels, _, _ = ARCHS[arch]
    READ.clear()
    torch.manual_seed(7)  # the new heads draw from here on both paths
    with Created() as created:
        if meta:
            model = meta_loaded(recipe(), head, labels, folder, torch.device("cpu"), ctx)
        else:
            model, _ = load_model(str(folder), head=head, num_labels=labels)
            model.train()
            ctx.broadcast_parameters(model)
            shard_model(model)
    return model, created.largest, sum(READ)


def gathered(model) -> dict:
    params = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for name, p in model.named_parameters()}
    buffers = {f"buffer:{name}": b.detach().clone() for name, b in model.named_buffers()}
    return {**params, **buffers}


def tied(model) -> list[bool]:
    names: dict = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return sorted(tuple(v) for v in names.values() if len(v) > 1)


def worker(out: Path) -> None:
    from dptext.finetune.distributed import current, release

    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"  # from_pretrained loads in this thread, where Created sees it
    ctx = current("cpu")
    count_reads()
    results = {}
    for arch in ARCHS:
        folder = out / arch
        if ctx.rank == 0:
            save_folder(arch, folder)
        torch.distributed.barrier()
        meta, meta_largest, meta_read = loaded(arch, folder, ctx, meta=True)
        whole, whole_largest, _ = loaded(arch, folder, ctx, meta=False)
        values, expected = gathered(meta), gathered(whole)
        results[arch] = {
            "names": (sorted(values), sorted(expected)),
            "differ": [k for k in expected if k in values and not (values[k].dtype == expected[k].dtype
                                                                  and torch.equal(values[k], expected[k]))],
            "tied": (tied(meta), tied(whole)), "largest": (meta_largest, whole_largest),
            "largest_param": max(p.numel() for p in whole.parameters()),
            "read": meta_read, "own": sum(p.to_local().numel() for p in meta.parameters()),
            "buffers": sum(b.numel() for b in whole.buffers()),
        }
    torch.save(results, out / f"rank{ctx.rank}.pt")
    release()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_two_ranks(__file__, tmp_path_factory.mktemp("ranks"), TIMEOUT)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_meta_path_loads_what_the_whole_model_path_loads(two_ranks, arch):
    for rank in two_ranks:
        result = rank[arch]
        assert result["names"][0] == result["names"][1]
        assert result["differ"] == []
        assert result["tied"][0] == result["tied"][1]


@pytest.mark.parametrize("arch", ARCHS)
def test_no_rank_holds_the_whole_model_on_the_meta_path(two_ranks, arch):
    for rank in two_ranks:
        result = rank[arch]
        meta_largest, whole_largest = result["largest"]
        if ARCHS[arch][4] != torch.float32:  # today's path casts each whole parameter to fp32: the check can fail
            assert whole_largest >= result["largest_param"]  # (fp32 files it maps whole instead of allocating)
        assert meta_largest < result["largest_param"], "a whole parameter was created on the meta path"
        assert result["read"] <= result["own"] + result["buffers"], "more than its own rows were read"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    worker(Path(sys.argv[1]))
