"""Public-support DP decoding: sample only among the top-k tokens of a *public* model.

SPEC §5: restricting the support to k tokens is valid only if the private model plays no
part in choosing them; then |V| becomes k in ε, since every entry of q' inside the support
lies in [(1 − λ)/k, λ + (1 − λ)/k] and every entry outside is 0 for any private model.
Choosing the k tokens with the private model would leak through *which* tokens can appear,
which is why top-k/top-p on the private model are refused everywhere else.

The public model sees the same context as the private one (prompt plus the tokens sampled so
far, which are already DP outputs), so it must share the tokenizer and the output dimension.
"""

from __future__ import annotations

import torch

from dptext.decoding.processor import DPSamplingLogitsProcessor
from dptext.errors import UserError


def output_vocab_size(model) -> int:
    """The model's output dimension (logits size), the |V| of the guarantee."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is not None:
        return int(weight.shape[0])
    return int(model.config.get_text_config().vocab_size)


def check_shared_vocabulary(private_model, private_tokenizer, public_model, public_tokenizer) -> None:
    """Refuse a public model whose token ids mean something else than the private model's."""
    private_size, public_size = output_vocab_size(private_model), output_vocab_size(public_model)
    if private_size != public_size:
        raise UserError(f"The public model has {public_size} output tokens but the private model has "
                        f"{private_size}; the public support must come from a model with the same vocabulary.")
    if private_tokenizer.get_vocab() != public_tokenizer.get_vocab():
        raise UserError("The public and private models use different tokenizers (token ids differ), so the public "
                        "top-k would pick the wrong tokens; choose a public model with the same tokenizer.")


def check_public_is_independent(private_model, public_model) -> None:
    """Refuse a "public" model that is the private model or shares any of its weights (e.g. the base model
    object a LoRA adapter was injected into): its top-k would be chosen with private information."""
    def storages(model) -> set[int]:
        return {p.data_ptr() for p in model.parameters() if p.numel() and p.data_ptr()}

    shared = public_model is private_model or bool(storages(private_model) & storages(public_model))
    if shared:
        raise UserError("The public model is the private model or shares weights with it, so its top-k would be "
                        "chosen with the private model and ε with |V| = k would not hold; load a separate public "
                        "model (e.g. the pre-trained base) or drop --public-model.")


class PublicTopKDPLogitsProcessor(DPSamplingLogitsProcessor):
    """λ-perturbed sampling restricted to the top-k tokens of ``public_model`` at each step.

    The public model is re-run on the whole sequence at every step (no cache): simple and
    clearly right, at the price of O(T²) public compute, fine for the short outputs DP allows.
    ``prompt_attention_mask`` (left padding in a batch) is extended with ones for new tokens.
    """

    def __init__(self, lam: float, vocab_size: int, public_model, top_k: int, temperature: float = 1.0,
                 prompt_attention_mask: torch.Tensor | None = None, keep_outputs: bool = False):
        super().__init__(lam, vocab_size, temperature, keep_outputs)
        if not (1 <= int(top_k) <= vocab_size):
            raise UserError(f"--top-k must be between 1 and the vocabulary size {vocab_size}, got {top_k}.")
        self.top_k = int(top_k)
        self.public_model = public_model
        self.prompt_attention_mask = prompt_attention_mask

    def support_size(self) -> int:
        return self.top_k

    @torch.no_grad()
    def support(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        mask = torch.ones_like(input_ids)
        if self.prompt_attention_mask is not None:
            prompt = self.prompt_attention_mask.to(input_ids.device)
            mask[:, : prompt.shape[1]] = prompt
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        public_logits = self.public_model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                                          use_cache=False).logits[:, -1, :]
        chosen = public_logits.topk(self.top_k, dim=-1).indices.to(scores.device)
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen, True)
