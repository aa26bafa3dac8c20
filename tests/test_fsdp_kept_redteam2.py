"""Second red team of the sharded probe's saved all-gathers: 2 gloo ranks, Adam (budget: every unit). Its two
findings were against a version that kept units gathered between passes (disguised as resharded); they led to
the design now in ``proof.cached_gathers`` (FSDP2 runs as in training, a unit's later all-gathers served from a
copy of its first), which refuses both.

Attacks (see each test's comment): a model that tells a kept block from a resharded one by the storage of the
gathered weight it saw in the block's last forward (no write, no DTensor check); a global forward pre-hook that asks
whether the root's weights are registered sharded when the root's forward starts; a block called twice in one
forward; the state FSDP2 is left in for training (steps, gradient accumulation, ``verify()`` twice) compared
bit-for-bit with the probe keeping nothing. Run as a script by ``launch`` (``test_fsdp_kept_redteam``'s pattern).
"""

from __future__ import annotations

import contextlib
import os
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn
from fsdp_models import N, VOCAB, WIDTH, Block, TinyLM, losses, shard, token_ids
from test_fsdp_probe_gathers import without_copies
from two_ranks import CASES_VARIABLE, run_cases

TIMEOUT = 300
C = 0.5


def make_batch(examples, positions, generator):
    return {"input_ids": torch.randint(0, VOCAB, (examples, positions), generator=generator)}


def probe_loss(model, batch):
    return losses(model, batch["input_ids"])


class StorageBlock(Block):
    """A plain block that remembers the weight object FSDP2 registered on its layer in its last forward."""

    def __init__(self, width: int):
        super().__init__(width)
        self.store: dict = {}

    def forward(self, hidden):
        self.store["w"] = self.fc.weight  # the gathered nn.Parameter (FSDP2 keeps the object from pass to pass)
        if self.store.get("capture"):  # the storage object taken here (refused: a read outside the layer)
            self.store["s"] = self.fc.weight.untyped_storage()
        return super().forward(hidden)


class StoringLinear(nn.Linear):
    """A Linear that keeps the storage of the weight it was called with (read inside its own forward)."""

    def forward(self, hidden):
        self.__dict__["seen_storage"] = self.weight.untyped_storage()
        return super().forward(hidden)


class SeesStorage(TinyLM):
    """No write, no DTensor check: the root's forward asks whether the storage of the gathered weight block 0 used
    last time is still allocated. FSDP2 frees it when it reshards (every training pass starts so); a block the probe
    keeps gathered keeps it. It mixes the examples (detached batch mean) only when the storage was freed, else it
    replays the mean of the batch of this shape it saw fresh."""

    def __init__(self, hide=False):
        super().__init__()
        self.blocks = nn.ModuleList([StorageBlock(WIDTH), StorageBlock(WIDTH)])
        self.cache: dict = {}
        self.hide = hide
        self.blocks[0].store["capture"] = hide == "storage_object"
        if hide == "in_layer":
            for block in self.blocks:
                block.fc = StoringLinear(WIDTH, WIDTH)

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        key = tuple(hidden.shape[:2])
        seen = self.blocks[0].store.get("w")
        if self.hide == "in_layer":  # the storage the layer kept: an UntypedStorage method, no tensor touched
            storage = self.blocks[0].fc.__dict__.get("seen_storage")
            fresh = storage is None or storage.size() == 0
        elif self.hide == "storage_object":  # the storage object taken in the block: an UntypedStorage, no tensor
            fresh = "s" not in self.blocks[0].store or self.blocks[0].store["s"].size() == 0
        else:
            with torch._C.DisableTorchFunction() if self.hide else contextlib.nullcontext():
                fresh = seen is None or seen.untyped_storage().size() == 0
        if fresh or key not in self.cache:
            self.cache[key] = hidden.mean(dim=(0, 1)).detach()
        hidden = hidden + self.cache[key]
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


class RootHooked(TinyLM):
    """A global forward pre-hook (runs before FSDP2's own pre-forward) records whether the root's embedding is
    registered sharded (a DTensor) when the root's forward starts: always so in training (the root is resharded
    after every backward), never in the probe's re-draws (the root is kept gathered from the reference on). The
    forward mixes the examples only when it was."""

    def __init__(self):
        super().__init__()
        self.cache: dict = {}
        self.state = {"fresh": True}

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        key = tuple(hidden.shape[:2])
        if self.state["fresh"] or key not in self.cache:
            self.cache[key] = hidden.mean(dim=(0, 1)).detach()
        hidden = hidden + self.cache[key]
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


class Twice(TinyLM):
    """Block 0 called twice in one forward (an honest model: weight sharing by reuse)."""

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        hidden = self.blocks[0](self.blocks[0](hidden))
        return self.head(self.blocks[1](hidden))


HOOKS: list = []


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind.startswith("storage"):
        return SeesStorage(hide={"storage_hidden": True, "storage_object": "storage_object",
                                  "storage_in_layer": "in_layer"}.get(kind, False)).double()
    if kind == "root_hook":
        return RootHooked().double()
    if kind == "twice":
        return Twice().double()
    return TinyLM().double()


def install(kind: str, model: nn.Module) -> None:
    if kind == "root_hook":
        from torch.distributed.tensor import DTensor

        def pre(module, args):
            if module is model:
                model.state["fresh"] = isinstance(model.embed.weight, DTensor)
        HOOKS.append(torch.nn.modules.module.register_module_forward_pre_hook(pre))


def uninstall() -> None:
    while HOOKS:
        HOOKS.pop().remove()


def engine_for(model, ctx, optimizer: str, mode: str):
    from dptext.privacy import PrivacyEngine

    opt = (torch.optim.Adam(model.parameters(), lr=1e-2) if optimizer == "adam"
           else torch.optim.SGD(model.parameters(), lr=1.0))
    return PrivacyEngine(model, opt, noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=4, dataset_size=12,
                         clipping_mode=mode, distributed=ctx, verify=False)


def full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def verdict(ctx, kind: str, optimizer: str, mode: str = "bookkeeping", keep: bool = True):
    """'accepted' (with the report's statuses) or the probe's refusal."""
    from dptext.errors import UserError

    model = shard(build(kind), ctx)
    install(kind, model)
    engine = engine_for(model, ctx, optimizer, mode)
    try:
        with contextlib.nullcontext() if keep else without_copies():
            table = engine.verify(make_batch, probe_loss).table()
        result = "accepted " + str(sorted({row["status"] for row in table}))
    except UserError as error:
        result = "refused: " + str(error)
    finally:
        uninstall()
    engine.detach()
    return result, clean(model)


def clean(model) -> bool:
    """FSDP2 as training needs it after the probe (accepted or refused): every parameter registered sharded, no
    patch left on a param group, FSDP2's reshard settings as fully_shard left them, and a training pass works."""
    from dptext.privacy.sharding.fsdp_controls import param_groups

    groups = [group for _, group in param_groups(model)]
    ok = all(hasattr(param, "to_local") for param in model.parameters())
    ok &= not any(name in group.__dict__ for group in groups
                  for name in ("wait_for_unshard", "post_forward", "post_backward", "_to_sharded"))
    ok &= all(group.reshard_after_backward for group in groups)
    losses(model, token_ids()[:4]).sum().backward()
    model.zero_grad()
    ok &= all(hasattr(param, "to_local") for param in model.parameters())
    return bool(ok)


def training_leak(ctx, kind: str) -> float:
    """Under training's own passes (a forward and backward each, units gathered afresh), how far re-drawing the
    last example moves the other examples' losses."""
    model = shard(build(kind), ctx)
    install(kind, model)
    ids = token_ids()
    redrawn = ids.clone()
    redrawn[-1] = (redrawn[-1] + 3) % VOCAB
    out = []
    for batch in (ids, redrawn):
        loss = losses(model, batch)
        loss.sum().backward()  # a training pass: FSDP2 reshards every unit in its backward
        out.append(loss.detach()[:-1])
        model.zero_grad()
    uninstall()
    return float((out[0] - out[1]).abs().max())


def trained(ctx, kind: str, mode: str, keep: bool, verify_twice: bool = False) -> dict:
    """verify() (kept or not) with Adam, then two steps, the second accumulating two micro-batches: each
    parameter's move, gathered, and whether every parameter is registered sharded after the probe."""
    model = shard(build(kind), ctx)
    engine = engine_for(model, ctx, "adam", mode)
    with contextlib.nullcontext() if keep else without_copies():
        for _ in range(2 if verify_twice else 1):
            engine.verify(make_batch, probe_loss)
    resharded = all(hasattr(param, "to_local") for param in model.parameters())
    before = {name: full(p).detach().clone() for name, p in model.named_parameters()}
    ids = token_ids()[ctx.shard(N)]
    engine.accumulate(losses(model, ids))
    engine.step()
    engine.accumulate(losses(model, ids[:2]))
    engine.accumulate(losses(model, ids[2:]))
    engine.step()
    moves = {name: full(p).detach() - before[name] for name, p in model.named_parameters()}
    engine.detach()
    return {"moves": moves, "resharded": resharded}


VERDICTS = {  # name -> (kind, optimizer, mode, keep)
    "storage_adam": ("storage", "adam", "bookkeeping", True),
    "storage_hidden_adam": ("storage_hidden", "adam", "bookkeeping", True),
    "storage_hidden_adam_without_copies": ("storage_hidden", "adam", "bookkeeping", False),
    "storage_hidden_sgd": ("storage_hidden", "sgd", "bookkeeping", True),
    "storage_object_adam": ("storage_object", "adam", "bookkeeping", True),
    "storage_object_adam_ghost": ("storage_object", "adam", "ghost", True),
    "storage_object_adam_without_copies": ("storage_object", "adam", "bookkeeping", False),
    "root_hook_sgd": ("root_hook", "sgd", "bookkeeping", True),
    "root_hook_adam": ("root_hook", "adam", "bookkeeping", True),
    "root_hook_adam_without_copies": ("root_hook", "adam", "bookkeeping", False),
    "twice_adam": ("twice", "adam", "bookkeeping", True),
    "twice_adam_without_copies": ("twice", "adam", "bookkeeping", False),
}
TRAINED = {  # name -> (kind, mode, keep, verify_twice)
    **{f"{kind}_{mode}_{keep}": (kind, mode, keep, False) for kind in ("plain", "twice")
       for mode in ("bookkeeping", "ghost", "per_sample") for keep in (True, False)},
    "plain_bookkeeping_twice_verified": ("plain", "bookkeeping", True, True),
}
LEAKS = ("storage_hidden", "root_hook")


def worker(out: Path) -> None:
    from dptext.finetune.distributed import current, release
    from dptext.errors import UserError

    ctx = current("cpu")
    ctx.sharded = True
    wanted = os.environ.get(CASES_VARIABLE, "").split(",")
    results: dict = {}
    for name in wanted:
        if name in VERDICTS:
            results[name] = verdict(ctx, *VERDICTS[name])
        elif name in TRAINED:
            try:
                results[name] = trained(ctx, *TRAINED[name])
            except UserError as error:
                results[name] = "refused: " + str(error)
        elif name.startswith("leak_"):
            results[name] = training_leak(ctx, name.removeprefix("leak_"))
    torch.save(results, out / f"rank{ctx.rank}.pt")
    release()


launch = partial(run_cases, __file__, TIMEOUT)  # this file as 2 gloo ranks, running the cases given


@pytest.fixture(scope="module")
def attacks(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("attacks"), list(VERDICTS) + [f"leak_{k}" for k in LEAKS])


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("training"), list(TRAINED))


def test_the_attack_models_leak_in_training(attacks):
    # the control: under training's passes (forward and backward, units gathered afresh) re-drawing one example
    # moves the others' losses: every attack model below must be refused
    for rank in attacks:
        for kind in LEAKS:
            assert rank[f"leak_{kind}"] > 1e-6, (kind, rank[f"leak_{kind}"])


@pytest.mark.parametrize("case", ["storage_hidden_adam_without_copies", "storage_hidden_sgd",
                                  "storage_object_adam_without_copies",
                                  "root_hook_adam_without_copies"])
def test_the_attack_models_are_refused_when_nothing_is_kept(attacks, case):
    # the controls: with FSDP2 resharding after every pass (or no budget for the blocks) the re-draws see the mix
    for rank in attacks:
        assert rank[case][0].startswith("refused"), (case, rank[case])


@pytest.mark.parametrize("case", ["storage_adam", "storage_object_adam", "storage_object_adam_ghost"])
def test_asking_for_the_kept_weights_storage_through_a_tensor_is_refused(attacks, case):
    # Refused (regression): asking the gathered weight for its storage (``untyped_storage()``) in the root's
    # forward or in the block's is a read outside the layer for the probe's read detector, kept or not. (A Linear
    # subclass asking in its own forward needs per_sample, whose torch.func wrappers have no storage: the model's
    # own NotImplementedError; left out.)
    for rank in attacks:
        assert rank[case][0].startswith("refused"), (case, rank[case])
        assert rank[case][1], "FSDP2 left unfit for training after the refusal"


def test_a_model_that_asks_whether_a_kept_blocks_storage_was_freed_is_refused(attacks):
    # Found by the red team against the kept-gathered version: the model remembers the gathered weight object
    # its block 0 used (a dict entry, no read) and, in the root's forward, asks whether its storage is still
    # allocated (``untyped_storage().size()`` under ``torch._C.DisableTorchFunction()``, hidden from the read
    # detector); it mixes the examples only when FSDP2 freed it (every training pass) and replays the mix of the
    # batch it saw fresh otherwise. Refused now: FSDP2 frees and refills the storage as in training (a copy
    # serves the refill instead of an all-gather), so the re-draws see the mix.
    for rank in attacks:
        assert rank["storage_hidden_adam"][0].startswith("refused"), rank["storage_hidden_adam"]


@pytest.mark.parametrize("case", ["root_hook_adam", "root_hook_sgd"])
def test_a_global_hook_that_asks_whether_the_root_is_registered_sharded_is_refused(attacks, case):
    # Found by the red team, older than the saved gathers (the root was kept gathered from the reference into
    # the re-draws since session 27): a global forward pre-hook (``register_module_forward_pre_hook``, which runs
    # before FSDP2's own pre-forward) checks whether the root's embedding weight is a DTensor when the root's
    # forward starts — always so in training (FSDP2 reshards the root after each backward), never in the
    # re-draws then — and the root mixes the examples only when it is. Refused now: nothing is kept gathered
    # (FSDP2 reshards the root after each backward as in training; a copy serves the next gather).
    for rank in attacks:
        assert rank[case][0].startswith("refused"), (case, rank[case])


def test_a_block_called_twice_is_proven_as_with_without_copies(attacks):
    # Refused nothing it should not (regression): block 0 called twice per forward (FSDP2's pre- and
    # post-backward run twice per backward, the disguise in between) gives the same report kept or not.
    for rank in attacks:
        assert rank["twice_adam"] == rank["twice_adam_without_copies"], (rank["twice_adam"],
                                                                     rank["twice_adam_without_copies"])
        assert rank["twice_adam"][0].startswith("accepted") and rank["twice_adam"][1]


@pytest.mark.parametrize("kind", ["plain", "twice"])
@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
def test_training_after_a_probe_that_kept_every_unit_is_bit_for_bit_that_after_one_that_kept_none(
        training, kind, mode):
    # Held (regression): with Adam every unit is kept; after the probe every parameter is registered sharded and
    # two steps (the second accumulating two micro-batches) move every parameter exactly as after the probe with
    # nothing kept, in every mode, also with a block called twice per forward.
    for rank in training:
        got, control = rank[f"{kind}_{mode}_True"], rank[f"{kind}_{mode}_False"]
        assert not isinstance(got, str) and not isinstance(control, str), (got, control)
        assert got["resharded"] and control["resharded"]
        for name, move in control["moves"].items():
            torch.testing.assert_close(got["moves"][name], move, rtol=0, atol=0)


def test_verify_twice_with_every_unit_kept_changes_nothing(training):
    for rank in training:
        got, control = rank["plain_bookkeeping_twice_verified"], rank["plain_bookkeeping_False"]
        assert not isinstance(got, str), got
        assert got["resharded"]
        for name, move in control["moves"].items():
            torch.testing.assert_close(got["moves"][name], move, rtol=0, atol=0)


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
