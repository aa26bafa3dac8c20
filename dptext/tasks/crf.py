"""A linear-chain CRF over slot tags (Lafferty et al. 2001; the slot layer of Dupuy et al.'s models).

``CRF(num_tags)(emissions, tags, mask)`` returns each example's negative log-likelihood, a (B,) tensor:
    nll_i = log Z_i − (start[y_1] + Σ_t emissions[t, y_t] + Σ_{t>1} transitions[y_{t−1}, y_t] + end[y_last])
summed over the example's own positions (``mask``; the first position of every example must be real).
``decode`` is Viterbi. The forward pass has no data-dependent Python branches (masks via ``torch.where``), so
``torch.func`` can vmap it: that is how the privacy engine gets the per-example gradients of the transition
parameters, which it clips like any other parameter (the rule registered at the bottom of this file).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dptext.privacy.norms import register_rule
from dptext.privacy.norms.functional import FunctionalRule


class CRF(nn.Module):
    def __init__(self, num_tags: int):
        super().__init__()
        self.num_tags = num_tags
        self.start = nn.Parameter(torch.zeros(num_tags))
        self.end = nn.Parameter(torch.zeros(num_tags))
        self.transitions = nn.Parameter(torch.zeros(num_tags, num_tags))  # [from, to]

    def forward(self, emissions: Tensor, tags: Tensor, mask: Tensor) -> Tensor:
        emissions = emissions.float()
        mask = mask.bool()
        tags = torch.where(mask, tags, torch.zeros_like(tags))  # padding may hold -100
        return self._log_partition(emissions, mask) - self._path_score(emissions, tags, mask)

    def _path_score(self, emissions: Tensor, tags: Tensor, mask: Tensor) -> Tensor:
        on = mask.to(emissions.dtype)
        emitted = emissions.gather(-1, tags.unsqueeze(-1)).squeeze(-1)
        moved = self.transitions[tags[:, :-1], tags[:, 1:]]
        last = tags.gather(1, (mask.sum(dim=1, keepdim=True) - 1).clamp(min=0)).squeeze(1)
        return self.start[tags[:, 0]] + (emitted * on).sum(1) + (moved * on[:, 1:]).sum(1) + self.end[last]

    def _log_partition(self, emissions: Tensor, mask: Tensor) -> Tensor:
        alpha = self.start + emissions[:, 0]  # (B, K): log-sum of all paths ending in each tag
        for t in range(1, emissions.shape[1]):
            moved = torch.logsumexp(alpha.unsqueeze(2) + self.transitions, dim=1) + emissions[:, t]
            alpha = torch.where(mask[:, t].unsqueeze(1), moved, alpha)
        return torch.logsumexp(alpha + self.end, dim=1)

    @torch.no_grad()
    def decode(self, emissions: Tensor, mask: Tensor) -> list[list[int]]:
        """The most likely tag sequence of each example (Viterbi), as many tags as its mask has positions."""
        emissions, mask = emissions.float(), mask.bool()
        score = self.start + emissions[:, 0]
        backpointers = []
        for t in range(1, emissions.shape[1]):
            best, index = (score.unsqueeze(2) + self.transitions).max(dim=1)
            backpointers.append(index)
            score = torch.where(mask[:, t].unsqueeze(1), best + emissions[:, t], score)
        score = score + self.end
        paths = []
        for row, length in enumerate(mask.sum(dim=1).tolist()):
            tag = int(score[row].argmax())
            path = [tag]
            for t in range(length - 1, 0, -1):
                tag = int(backpointers[t - 1][row, tag])
                path.append(tag)
            paths.append(path[::-1])
        return paths


# The transitions' per-example gradients are K×K (small), so they are instantiated: torch.func vmaps the
# vector-Jacobian product of this layer over the batch (exact; checked against per-example autograd in the tests).
register_rule(CRF)(FunctionalRule)
