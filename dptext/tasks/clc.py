"""The "CLC" encoder of Dupuy et al. §4.2 (after Ma & Hovy 2016): a character CNN per word concatenated with a
word embedding, then two bi-LSTM layers. ``model.name: clc`` (the paper's sizes) or ``tiny-clc`` (tests), with
``task.type: intent_slot``, which puts its intent and slot heads (and the optional CRF) on top.

Vocabularies are public and fixed, never built from the training split (a vocabulary read off the private
records would ship every word they contain with the model): the words are the whole-word entries of the
pretrained minilm-l6 (BERT uncased) WordPiece vocabulary, the characters printable ASCII
(``dptext.models.word_tokenizer``); anything else is <unk>. The paper initialises the word embeddings from pretrained
FastText vectors (whose vocabulary is public too); those are not available offline, so here they start random
(a stated difference).

Privacy: every parameter has a per-example rule. The char CNN is an ``nn.Embedding`` and an ``nn.Linear`` over
unfolded character windows (the engine's own rules); the recurrent layers are ``BiLSTM`` modules written with
plain tensor operations (``nn.LSTM`` returns a tuple and runs fused kernels the engine cannot see into), whose
per-example gradients the engine obtains exactly with ``torch.func`` (vmap of the layer's vector-Jacobian
product, registered below), in every clipping mode.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers.modeling_outputs import BaseModelOutput

from dptext.models.word_tokenizer import PAD, WordTokenizer
from dptext.privacy.norms import register_rule
from dptext.privacy.norms.functional import FunctionalRule


@dataclass
class CLCConfig:
    word_dim: int
    char_dim: int
    char_filters: int
    char_window: int
    hidden: int  # per direction; the output has 2·hidden features
    layers: int
    word_vocab: int = 0
    char_vocab: int = 0

    @property
    def hidden_size(self) -> int:
        return 2 * self.hidden


SIZES = {  # the paper: two bi-LSTM layers of 384; FastText's 300-d words; Ma & Hovy's 30 filters of width 3
    "clc": dict(word_dim=300, char_dim=30, char_filters=30, char_window=3, hidden=384, layers=2),
    "tiny-clc": dict(word_dim=16, char_dim=8, char_filters=8, char_window=3, hidden=12, layers=2),
}


class BiLSTM(nn.Module):
    """One bidirectional LSTM layer over (B, W, D) with a (B, W) mask → (B, W, 2H), zero at padding.

    Gates i, f, g, o as in nn.LSTM. The backward direction starts at each example's last real word: its state
    stays zero over the trailing padding."""

    def __init__(self, input_size: int, hidden: int):
        super().__init__()
        self.hidden = hidden
        bound = hidden ** -0.5  # nn.LSTM's initialisation
        self.weight_ih = nn.Parameter(torch.empty(2, 4 * hidden, input_size).uniform_(-bound, bound))
        self.weight_hh = nn.Parameter(torch.empty(2, 4 * hidden, hidden).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(2, 4 * hidden).uniform_(-bound, bound))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        keep = mask.to(x.dtype).unsqueeze(-1)
        outputs = []
        for direction, steps in ((0, range(x.shape[1])), (1, reversed(range(x.shape[1])))):
            projected = x @ self.weight_ih[direction].T + self.bias[direction]  # all positions at once
            h = x.new_zeros(x.shape[0], self.hidden)
            c = x.new_zeros(x.shape[0], self.hidden)
            states = [None] * x.shape[1]
            for t in steps:
                gates = projected[:, t] + h @ self.weight_hh[direction].T
                i, f, g, o = gates.chunk(4, dim=-1)
                c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h_new = torch.sigmoid(o) * torch.tanh(c_new)
                c = keep[:, t] * c_new + (1 - keep[:, t]) * c
                h = keep[:, t] * h_new + (1 - keep[:, t]) * h
                states[t] = h_new * keep[:, t]
            outputs.append(torch.stack(states, dim=1))
        return torch.cat(outputs, dim=-1)


class CLCEncoder(nn.Module):
    """char CNN ⊕ word embedding → dropout → ``layers`` × BiLSTM; returns ``last_hidden_state`` (B, W, 2H)."""

    def __init__(self, config: CLCConfig, dropout: float = 0.25):
        super().__init__()
        self.config = config
        self.word_embedding = nn.Embedding(config.word_vocab, config.word_dim, padding_idx=PAD)
        self.char_embedding = nn.Embedding(config.char_vocab, config.char_dim, padding_idx=PAD)
        self.char_conv = nn.Linear(config.char_window * config.char_dim, config.char_filters)
        self.dropout = nn.Dropout(dropout)
        sizes = [config.word_dim + config.char_filters] + [2 * config.hidden] * (config.layers - 1)
        self.lstm = nn.ModuleList(BiLSTM(size, config.hidden) for size in sizes)

    def char_features(self, char_ids: Tensor) -> Tensor:
        """(B, W, L) character ids → (B, W, F): a width-k convolution as a Linear over windows, max over them."""
        batch, words, length = char_ids.shape
        window = self.config.char_window
        if length < window:
            char_ids = nn.functional.pad(char_ids, (0, window - length), value=PAD)
            length = window
        chars = self.char_embedding(char_ids.reshape(batch, words * length)).reshape(batch, words, length, -1)
        windows = chars.unfold(2, window, 1).transpose(-1, -2)  # (B, W, L-k+1, k, e)
        positions = windows.shape[2]
        filters = self.char_conv(windows.reshape(batch, words * positions, -1)).reshape(batch, words, positions, -1)
        present = (char_ids != PAD).unfold(2, window, 1)[..., 0].clone()  # windows starting on a real character
        present[..., 0] = True  # every word has at least its first window
        return filters.masked_fill(~present.unsqueeze(-1), float("-inf")).amax(dim=2)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, char_ids: Tensor) -> BaseModelOutput:
        features = torch.cat([self.word_embedding(input_ids), self.char_features(char_ids)], dim=-1)
        states = self.dropout(features)
        for layer in self.lstm:
            states = self.dropout(layer(states, attention_mask))
        return BaseModelOutput(last_hidden_state=states)

    def save_pretrained(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text(json.dumps({"architecture": "clc", **asdict(self.config)}))
        torch.save(self.state_dict(), Path(path) / "clc_encoder.pt")


def build_clc(name: str, tokenizer: WordTokenizer, seed: int) -> CLCEncoder:
    config = CLCConfig(**SIZES[name], word_vocab=len(tokenizer.words), char_vocab=len(tokenizer.chars))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return CLCEncoder(config)


# Per-example gradients of the recurrent weights: torch.func vmaps the layer's vector-Jacobian product over the
# batch (instantiated, exact; checked against per-example autograd in tests/test_intent_slot_clc.py).
register_rule(BiLSTM)(FunctionalRule)
