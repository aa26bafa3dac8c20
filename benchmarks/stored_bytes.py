"""What book-keeping stores per token, against what autograd itself saves, as the sequence grows (issue 42).

    python benchmarks/stored_bytes.py [--lengths 128,512,2048] [--layers 1] [--batch 1] [--tiny] [--out FILE.json]

Book-keeping keeps, for every tracked layer, its input activation and its output gradient until the whole-model
norm of each example is known (``dptext.privacy.clipping.capture.Use``); a non-private step frees each layer's
saved tensors as the backward pass leaves it. This measures, on a TinyLlama-shaped model (hidden 2048, GQA 32/8,
intermediate 5632, random weights built in code; ``--tiny``: hidden 64), at each length T:
* ``records_bytes_per_token_per_layer``: the distinct storages the engine's records hold when the backward pass
  ends (activations and output gradients; a tensor shared by q/k/v is counted once), per token per decoder layer;
* ``autograd_bytes_per_token_per_layer``: the distinct storages autograd saves for the backward pass of the same
  forward (``torch.autograd.graph.saved_tensors_hooks``), per token per decoder layer — the activation memory a
  non-private step holds at its peak;
* their ratio, and the part of the records made of output gradients (what a norm taken in the backward hook would
  not keep). Bytes per token are constant in T for both (attention's T² scores are saved by autograd in eager
  attention, not by the records), so the ratio says how much longer a sequence non-private training can afford.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from max_model import build  # noqa: E402


def storage_bytes(tensors, exclude: set[int] = frozenset()) -> int:
    """The bytes of the distinct storages behind ``tensors``, leaving out those in ``exclude`` (data pointers)."""
    seen, total = set(exclude), 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def measure(length: int, layers: int, batch: int, tiny: bool) -> dict:
    from dptext.privacy import PrivacyEngine, causal_lm_loss
    from dptext.privacy.clipping import clipped_step

    model = build(layers, tiny, "cpu")
    model.train()
    ids = torch.randint(1, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model(input_ids=ids, attention_mask=mask).logits.float().sum()
    weights = {param.untyped_storage().data_ptr() for param in model.parameters()}
    autograd = storage_bytes(saved, weights)  # the weights autograd saves are the model's, not activations
    del saved
    engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=1.0,
                           max_grad_norm=1.0, expected_batch_size=batch, dataset_size=1000, verify=False)
    seen = {}
    real = clipped_step.checked_uses

    def inspect(engine_, loss):
        uses = real(engine_, loss)
        if uses:
            in_blocks = [use for use in uses if ".layers." in engine_.names.get(use.module, "")]
            activations = [use.activation[0] if isinstance(use.activation, tuple) else use.activation
                           for use in in_blocks]
            seen["records"] = storage_bytes(activations + [use.grad_output for use in in_blocks])
            seen["grads"] = storage_bytes([use.grad_output for use in in_blocks])
        return uses

    clipped_step.checked_uses = inspect
    try:
        engine.accumulate(causal_lm_loss(model(input_ids=ids, attention_mask=mask).logits, ids, mask))
    finally:
        clipped_step.checked_uses = real
    tokens = batch * length
    per_layer = {key: value / tokens / layers for key, value in seen.items()}
    # autograd's saves include the embedding, head and loss outside the blocks: attributed per layer too (an upper
    # bound on the blocks' own share, so the ratio below is a lower bound on book-keeping's extra at few layers)
    autograd_per = autograd / tokens / layers
    return {"length": length, "records_bytes_per_token_per_layer": per_layer["records"],
            "of_which_output_gradients": per_layer["grads"],
            "autograd_bytes_per_token_per_layer": autograd_per,
            "records_over_autograd": per_layer["records"] / autograd_per}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="128,512,2048")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rows = [measure(int(n), args.layers, args.batch, args.tiny) for n in args.lengths.split(",")]
    for row in rows:
        print(json.dumps(row), flush=True)
    result = {"model": "TinyLlama shape" + (" (tiny)" if args.tiny else ""), "layers": args.layers,
              "batch": args.batch, "dtype": "float32", "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
