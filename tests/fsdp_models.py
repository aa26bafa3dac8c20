"""The tiny fp64 models and batches of tests/test_fsdp.py (its worker processes import them too)."""

from __future__ import annotations

import torch
from torch import nn

N, VOCAB, WIDTH = 12, 11, 6


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, hidden):
        return self.norm(hidden + torch.tanh(self.fc(hidden)))


class TinyLM(nn.Module):
    """Embedding, two blocks, an LM head tied to the embedding (its clipping needs both uses' cross terms)."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def tiny_lm() -> nn.Module:
    torch.manual_seed(0)
    return TinyLM().double()


def token_ids():
    return torch.randint(0, VOCAB, (N, 5), generator=torch.Generator().manual_seed(1))


def losses(model, ids):
    logits = model(ids)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1),
                                       reduction="none").view(ids.shape[0], -1).sum(dim=1)


def shard(model, ctx, blocks=None):
    from dptext.finetune.sharding import shard_model

    if ctx is not None:
        shard_model(model, list(model.blocks) if blocks is None else blocks)
    return model


def refusal(action) -> str:
    """The UserError's sentence, or "" when ``action`` went through; any other error fails the worker."""
    from dptext.errors import UserError

    try:
        action()
    except UserError as error:
        return str(error)
    return ""


def full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class FunctionalHead(TinyLM):
    """The LM head as ``F.linear(h, embed.weight)``: a read outside the embedding that ghost's norms would miss."""

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        return nn.functional.linear(hidden, self.embed.weight)
