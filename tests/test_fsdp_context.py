"""An FSDP2-sharded model needs the engine's sharded path (``privacy.sharding.sharded.check_sharded_context``).

Built without a distributed context, with one not marked sharded, or over a single process (where the context is
inactive), the engine used to crash inside DTensor (book-keeping, per_sample: a raw RuntimeError) or, in ghost
mode, take FSDP2's mean over the ranks for its clipped sum while each rank's engine believed it was alone; it is
refused in one sentence at construction, in every clipping mode, before any hook is attached. With the sharded
context on two ranks it trains (tests/test_fsdp*.py cover that path).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from fsdp_models import TinyLM, losses, shard, token_ids
from two_ranks import run_two_ranks

MODES = ("bookkeeping", "ghost", "per_sample")
CONTEXTS = ("none", "not_sharded", "sharded")


def attempt(ctx, mode: str, given: str) -> str:
    """"trained", or the refusal's sentence."""
    from dptext.errors import UserError
    from dptext.privacy import PrivacyEngine

    torch.manual_seed(0)
    model = shard(TinyLM().double(), ctx)
    context = {"none": None, "not_sharded": replace(ctx, sharded=False), "sharded": ctx}[given]
    try:
        engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                               max_grad_norm=0.5, expected_batch_size=4, dataset_size=12, clipping_mode=mode,
                               distributed=context, verify=False)
    except UserError as error:
        return str(error)
    engine.accumulate(losses(model, token_ids()[:4]))
    engine.step()
    engine.detach()
    return "trained"


def worker(out: Path) -> None:
    from dptext.finetune.distributed import current, release

    ctx = current("cpu")
    ctx.sharded = True
    results = {(mode, given): attempt(ctx, mode, given) for mode in MODES for given in CONTEXTS}
    torch.save(results, out / f"rank{ctx.rank}.pt")
    release()


@pytest.fixture(scope="module", params=[1, 2], ids=["one_process", "two_ranks"])
def ranks(request, tmp_path_factory):
    return request.param, run_two_ranks(__file__, tmp_path_factory.mktemp("ranks"), 180, ranks=request.param)


@pytest.mark.parametrize("mode", MODES)
def test_a_sharded_model_without_the_sharded_path_is_refused_in_one_sentence(ranks, mode):
    count, results = ranks
    for rank in results:
        for given in CONTEXTS:
            got = rank[(mode, given)]
            if given == "sharded" and count == 2:
                assert got == "trained", got
            else:  # one process: the context is inactive whatever it says
                assert "FSDP2 shards" in got and "sharded=True" in got, (given, got)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    worker(Path(sys.argv[1]))
