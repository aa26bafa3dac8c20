"""What a user changes after the privacy engine was built on an FSDP2-sharded model (issue 43), for the 2-process
launch of tests/test_fsdp_redteam.py (its worker processes import this).

* A layer frozen after the engine: refused at the next step on every rank until ``engine.replan()``; after it the
  frozen layer is neither noised nor updated (bit-identical) and one step is accounted. Book-keeping and per_sample
  keep the planned parameters' ``requires_grad`` off and FSDP2's shards are DTensors, so the freeze is seen through
  the engine's DTensor subclass (``dptext/privacy/clipping/owned_params.py``); ghost sees the flag itself.
* The subclass stays with the engine: a copy or a pickle is a plain DTensor, ``detach()`` gives plain ones back.
* The step's other checks, as in one process: a backward pass the engine did not issue, the optimizer stepped
  directly, a parameter replaced (``load_state_dict(assign=True)``), a global module hook added after the plan.
"""

from __future__ import annotations

import copy
import io

import torch
from fsdp_models import N, full, losses, refusal, shard, tiny_lm, token_ids

C, SIGMA, DELTA = 0.5, 1.0, 1e-5
FROZEN = "blocks.1.fc."
# (clipping mode, how the layer is frozen): both spellings reach the same class, so each mode takes one of them
FREEZES = (("bookkeeping", "method"), ("bookkeeping", "attribute"), ("per_sample", "attribute"), ("ghost", "method"))


def engine_for(model, mode, ctx, sigma=SIGMA):
    from dptext.privacy import PrivacyEngine

    return PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=sigma,
                         max_grad_norm=C, expected_batch_size=N, dataset_size=10 * N, clipping_mode=mode, seed=3,
                         distributed=ctx, verify=False)


def gathered(model) -> dict:
    return {name: full(p).detach().clone() for name, p in model.named_parameters()}


def freeze(layer, how: str) -> None:
    if how == "method":
        layer.requires_grad_(False)
    else:
        for param in layer.parameters():
            param.requires_grad = False


def frozen_after_the_engine(ctx, mode: str, how: str) -> dict:
    """blocks.1.fc frozen after the engine: the next step refused, then ``replan()`` and a noisy step."""
    model = shard(tiny_lm(), ctx)
    engine = engine_for(model, mode, ctx)
    freeze(model.blocks[1].fc, how)
    before = gathered(model)
    refused = {"refusal": refusal(lambda: engine.step(losses(model, token_ids()[ctx.shard(N)]))),
               "unchanged": gathered(model), "steps": engine.steps}
    engine.replan(verify=False)
    still_frozen = not any(p.requires_grad for p in model.blocks[1].fc.parameters())
    engine.step(losses(model, token_ids()[ctx.shard(N)]))  # σ = 1: every planned coordinate is noised
    return {"before": before, "refused": refused, "still_frozen": still_frozen, "after": gathered(model),
            "steps": engine.steps, "epsilon": engine.epsilon(DELTA), "sample_rate": engine.sample_rate}


def class_round_trip(ctx) -> dict:
    """Book-keeping's sharded parameters: a copy and a pickle are plain DTensors without the engine's mark, and
    ``detach()`` gives the model back plain DTensors that keep the user's freeze."""
    from torch.distributed.tensor import DTensor

    model = shard(tiny_lm(), ctx)
    engine = engine_for(model, "bookkeeping", ctx)
    param = model.blocks[0].fc.weight
    planned_class = type(param).__name__
    param.requires_grad_(False)  # a freeze: marked on the parameter
    copied = copy.deepcopy(param)
    buffer = io.BytesIO()
    torch.save(param, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    engine.detach()
    return {"planned_class": planned_class,
            "copy": type(copied) is DTensor and "_dptext_frozen_since_plan" not in copied.__dict__
            and torch.equal(copied.to_local(), param.to_local()),
            "pickle": type(loaded) is DTensor and torch.equal(loaded.to_local(), param.to_local()),
            "detached": all(type(p) is DTensor for p in model.parameters()),
            "freeze_kept": not param.requires_grad and model.blocks[1].fc.weight.requires_grad}


def foreign_backward(model, engine, ids) -> None:
    loss = losses(model, ids)
    if loss.requires_grad:  # book-keeping and per_sample: autograd reaches the layers through the engine's hooks
        loss.sum().backward()
    engine.step(losses(model, ids))


def optimizer_stepped(model, engine, ids) -> None:
    loss = losses(model, ids)
    if loss.requires_grad:
        loss.sum().backward()
    engine.optimizer.step()


def replaced(model, engine, ids) -> None:
    model.load_state_dict({key: value.clone() for key, value in model.state_dict().items()}, assign=True)
    engine.step(losses(model, ids))


def global_hook(model, engine, ids) -> None:
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
    try:
        engine.step(losses(model, ids))
    finally:
        handle.remove()


CHANGES = {  # a change after the plan -> the words of its refusal
    "foreign backward": (foreign_backward, "A backward pass the privacy engine did not issue"),
    "optimizer stepped": (optimizer_stepped, "was stepped directly"),
    "parameter replaced": (replaced, "is no longer in the model"),
    "global hook": (global_hook, "A global module hook"),
}


def changed_after_the_engine(ctx, mode: str, change: str) -> dict:
    """One change after the plan: its refusal and the model unchanged by it; after a foreign backward, the next
    step's update (noise-free), which must be a clean step's (no raw gradient left behind)."""
    model = shard(tiny_lm(), ctx)
    engine = engine_for(model, mode, ctx, sigma=0.0)
    ids = token_ids()[ctx.shard(N)]
    before = gathered(model)
    said = refusal(lambda: CHANGES[change][0](model, engine, ids))
    result = {"refusal": said, "unchanged": all(torch.equal(p, before[name])
                                                for name, p in gathered(model).items())}
    if change == "foreign backward":
        engine.step(losses(model, ids))
        result["next"] = {name: p - before[name] for name, p in gathered(model).items()}
        clean = shard(tiny_lm(), ctx)
        engine_for(clean, mode, ctx, sigma=0.0).step(losses(clean, ids))
        result["clean"] = {name: p - before[name] for name, p in gathered(clean).items()}
    return result
