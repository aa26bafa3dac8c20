"""Third red team of the sharded probe's copied all-gathers (``proof.cached_gathers``): 2 gloo ranks, Adam (budget:
every unit), the builders, ``verdict`` and ``launch`` pattern of ``test_fsdp_kept_redteam2``.

Attacks: a block that flips the sign of a zero in its own shard (``+0.0`` <-> ``-0.0``: ``torch.equal`` calls them
equal, so a value comparison kept the copy "valid" while a real all-gather shows the flip) and so tells a copied
gather from a real one — refused since the copy is compared bit for bit; the controls (nothing copied, SGD: only
the root copied) and the state FSDP2 is left in after it.
Run as a script by ``launch``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from fsdp_models import VOCAB, WIDTH, Block, TinyLM, losses, shard, token_ids
from test_fsdp_probe_gathers import without_copies
from two_ranks import CASES_VARIABLE, run_cases

TIMEOUT = 240
C = 0.5


def make_batch(examples, positions, generator):
    return {"input_ids": torch.randint(0, VOCAB, (examples, positions), generator=generator)}


def probe_loss(model, batch):
    return losses(model, batch["input_ids"])


def own_fsdp_param(module: nn.Module, name: str):
    for group in module._get_fsdp_state()._fsdp_param_groups:
        for param in group.fsdp_params:
            if param._module_info.module is module and param._module_info.param_name == name:
                return param
    raise LookupError(name)


class SignBlock(Block):
    """A block with a frozen ``mark`` whose entries 0 and 2 (each rank's first shard entry) are zero. Each forward
    compares the sign of its rank's own entry in the gathered ``mark`` with the sign of the same entry in its shard,
    then writes into the shard a zero of the other sign than the gathered one (under
    ``_unsafe_preserve_version_counter``: the value, the sum, the storage and the version are unchanged; only the
    sign bit of a zero). A real all-gather always shows the
    shard's sign (fresh); a copy shows the sign of its first gather. From its second forward on it mixes the
    examples (detached batch mean) on every fresh pass, so training (no copies) mixes on every pass."""

    def __init__(self, width: int):
        super().__init__(width)
        self.mark = nn.Parameter(torch.tensor([0.0, 1.0, 0.0, 1.0]), requires_grad=False)
        self.state = {"passes": 0, "log": []}

    def forward(self, hidden):
        with torch.no_grad(), torch._C.DisableTorchFunction():
            data = own_fsdp_param(self, "mark")._sharded_param_data
            rank = dist.get_rank()
            seen = bool(torch.signbit(self.mark[2 * rank]))
            fresh = seen == bool(torch.signbit(data[0]))
            with torch.autograd._unsafe_preserve_version_counter(data):
                data[0] = 0.0 if seen else -0.0  # the other sign than the one gathered
        self.state["passes"] += 1
        self.state["log"].append(fresh)
        if fresh and self.state["passes"] >= 2:
            hidden = hidden + hidden.mean(dim=(0, 1)).detach()
        return super().forward(hidden)


class SignLM(TinyLM):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([SignBlock(WIDTH), Block(WIDTH)])


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "sign":
        return SignLM().double()
    return TinyLM().double()


def engine_for(model, ctx, optimizer: str, mode: str):
    from dptext.privacy import PrivacyEngine

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-2) if optimizer == "adam" else torch.optim.SGD(params, lr=1.0)
    return PrivacyEngine(model, opt, noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=4, dataset_size=12,
                         clipping_mode=mode, distributed=ctx, verify=False)


def leak(model) -> float:
    """Training's passes (forward and backward, every unit gathered afresh): how far re-drawing the last example
    moves the other examples' losses, after one warm-up pass."""
    ids = token_ids()
    redrawn = ids.clone()
    redrawn[-1] = (redrawn[-1] + 3) % VOCAB
    out = []
    for batch in (ids, ids, redrawn):
        loss = losses(model, batch)
        loss.sum().backward()
        out.append(loss.detach()[:-1])
        model.zero_grad()
    return float((out[1] - out[2]).abs().max())


def clean(model) -> bool:
    """Every parameter registered sharded and no patch (``unshard``/``wait_for_unshard`` included) left on a
    param group after the probe."""
    from dptext.privacy.sharding.fsdp_controls import param_groups

    groups = [group for _, group in param_groups(model)]
    ok = all(hasattr(param, "to_local") for param in model.parameters())
    ok &= not any(name in group.__dict__ for group in groups
                  for name in ("unshard", "wait_for_unshard", "post_forward", "post_backward", "_to_sharded"))
    ok &= all(group._all_gather_result is None for group in groups)
    return bool(ok)


def verdict(ctx, kind: str, optimizer: str, mode: str = "bookkeeping", keep: bool = True):
    """('accepted [...]' or the refusal, FSDP2 clean after it, the leak of training's passes after the probe,
    the sign block's fresh/copied log during the probe)."""
    from dptext.errors import UserError

    model = shard(build(kind), ctx)
    engine = engine_for(model, ctx, optimizer, mode)
    try:
        with contextlib.nullcontext() if keep else without_copies():
            table = engine.verify(make_batch, probe_loss).table()
        result = "accepted " + str(sorted({row["status"] for row in table}))
    except UserError as error:
        result = "refused: " + str(error)
    log = list(getattr(model.blocks[0], "state", {}).get("log", []))
    ok = clean(model)
    engine.detach()
    return result, ok, leak(model), log


def training_leak(ctx, kind: str) -> float:
    return leak(shard(build(kind), ctx))


VERDICTS = {  # name -> (kind, optimizer, mode, keep)
    "sign_adam": ("sign", "adam", "bookkeeping", True),
    "sign_adam_ghost": ("sign", "adam", "ghost", True),
    "sign_adam_without_copies": ("sign", "adam", "bookkeeping", False),
    "sign_sgd": ("sign", "sgd", "bookkeeping", True),
}
LEAKS = ("sign",)


def worker(out: Path) -> None:
    from dptext.finetune.distributed import current, release

    ctx = current("cpu")
    ctx.sharded = True
    results: dict = {}
    for name in os.environ.get(CASES_VARIABLE, "").split(","):
        if name in VERDICTS:
            results[name] = verdict(ctx, *VERDICTS[name])
        elif name.startswith("leak_"):
            results[name] = training_leak(ctx, name.removeprefix("leak_"))
    torch.save(results, out / f"rank{ctx.rank}.pt")
    release()


launch = partial(run_cases, __file__, TIMEOUT)  # this file as 2 gloo ranks, running the cases given


@pytest.fixture(scope="module")
def attacks(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("attacks"), list(VERDICTS) + [f"leak_{k}" for k in LEAKS])


def test_the_sign_model_leaks_in_training(attacks):
    # the control: under training's passes the sign block mixes the examples on every pass after its first
    for rank in attacks:
        assert rank["leak_sign"] > 1e-6, rank["leak_sign"]


@pytest.mark.parametrize("case", ["sign_adam_without_copies", "sign_sgd"])
def test_the_sign_model_is_refused_when_its_block_is_gathered_for_real(attacks, case):
    # the controls: with no copies (or only the root's: SGD has no budget) every pass sees the shard's sign
    for rank in attacks:
        assert rank[case][0].startswith("refused"), (case, rank[case])
        assert rank[case][1], "FSDP2 left unfit for training after the refusal"


@pytest.mark.parametrize("case", ["sign_adam", "sign_adam_ghost"])
def test_a_shard_whose_zero_changes_sign_is_refused_with_copies(attacks, case):
    # Found by the red team: ``CachedGather.still_valid`` compared each rank's part of the copy with its shard by
    # ``torch.equal``, which calls +0.0 and -0.0 equal. A block that flips the sign of a zero in its own shard
    # (``_sharded_param_data``, under ``_unsafe_preserve_version_counter``: the probe's parameter fingerprint sees
    # the same version, storage and sum) kept the copy "valid" while a real all-gather shows the new sign; it told
    # a copied pass from a real one and mixed the examples only on real passes, so the probe with copies accepted
    # a model that leaks in training. Refused now: the copy is compared bit for bit (``cached_gathers.bits``).
    for rank in attacks:
        result, ok, after, log = rank[case]
        assert ok, "FSDP2 left unfit for training after the probe"
        assert result.startswith("refused"), (
            f"{case}: {result}; the block saw a copy on {log.count(False)} of {len(log)} passes; training after the "
            f"probe moves the other examples' losses by {after:.3g}")


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
