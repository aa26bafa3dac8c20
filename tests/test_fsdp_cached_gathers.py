"""The sharded probe serves a unit's later all-gathers from a copy of its first, for the units within the
optimizer-state budget (issue 42, ``dptext/privacy/proof/cached_gathers.py``): 2 gloo processes.

With Adam (two moments per parameter: a rank's share of them is as large as the whole gathered model on 2 ranks)
every unit is all-gathered once for the whole probe. Against the probe without copies: the same report, the same
(noise-free Adam) step after it, every unit resharded and FSDP2's settings put back. A forward writing into its
gathered weights in place gets what training gives it (FSDP2 drops the write when it gives the unit back), with
copies or without. With SGD (no state) only the root's gathers are copied; with optimizers that differ between the
ranks the smallest budget is taken (the units copied must be the same on every rank).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
from fsdp_models import N, shard, tiny_lm, token_ids
from test_fsdp_probe import make_batch, probe_loss
from test_fsdp_probe_gathers import counted_gathers, probed, without_copies
from test_fsdp_redteam import moves, outcome
from two_ranks import run_two_ranks

TIMEOUT = 240
MODES = ("bookkeeping", "ghost", "per_sample")


def write_in_place(module, args) -> None:
    """A layer's forward pre-hook writing into its weight in place, inside its own call (no outside read): the
    same values, so only the version counter moves."""
    with torch.no_grad():
        module.weight.mul_(1.0)


def writing_lm() -> torch.nn.Module:
    model = tiny_lm()
    model.blocks[1].fc.register_forward_pre_hook(write_in_place)
    return model


def adam_engine(model, mode, ctx, optimizer=torch.optim.Adam):
    from dptext.privacy import PrivacyEngine

    return PrivacyEngine(model, optimizer(model.parameters(), lr=0.1), noise_multiplier=0.0, max_grad_norm=0.5,
                         expected_batch_size=4, dataset_size=12, clipping_mode=mode, distributed=ctx, verify=False)


def chosen(ctx) -> dict:
    """Which units ``units_within_budget`` keeps besides the root, per optimizer."""
    from dptext.privacy.proof.cached_gathers import state_budget, units_within_budget

    model = shard(tiny_lm(), ctx)
    names = {module: name for name, module in model.named_modules()}
    optimizers = {"adam": torch.optim.Adam(model.parameters()), "sgd": torch.optim.SGD(model.parameters(), lr=1),
                  "momentum": torch.optim.SGD(model.parameters(), lr=1, momentum=0.9),
                  "rmsprop": torch.optim.RMSprop(model.parameters())}
    return {key: [names[unit] for unit in units_within_budget(model, state_budget(optimizer), ctx.world_size)]
            for key, optimizer in optimizers.items()}


def writing(ctx, optimizer) -> tuple:
    model = shard(writing_lm(), ctx)
    engine = adam_engine(model, "bookkeeping", ctx, optimizer)
    return outcome(lambda: engine.verify(make_batch, probe_loss).table())


def copies_after_a_shard_write(ctx) -> list:
    """Four forwards under the probe's copies, a shard written through ``.data`` (its own version counter) before
    the third: (real all-gathers, output) per forward."""
    from dptext.privacy.proof.cached_gathers import cached_gathers
    from dptext.privacy.proof.sharded_probe import sharded_view
    from dptext.privacy.sharding.fsdp_controls import fsdp_modules

    model = shard(tiny_lm(), ctx)
    engine = adam_engine(model, "bookkeeping", ctx)
    passes = []
    with counted_gathers() as counts, sharded_view(engine, model), cached_gathers(engine):
        for write in (False, False, True, False):
            if write:
                with torch.no_grad():
                    model.blocks[0].fc.weight.to_local().data.add_(0.5)
            before = sum(counts.values())
            with torch.no_grad(), engine.recorder.paused():
                output = model(token_ids()[:2])
            for unit in fsdp_modules(model):
                unit.reshard()
            passes.append((sum(counts.values()) - before, output))
    engine.detach()
    return passes


def smaller_mesh_after_forward(ctx, copies: bool) -> dict:
    """The blocks resharded after their forward to a mesh of one rank (``reshard_after_forward=1``: FSDP2 keeps a
    whole copy of each block's weights between its forward and backward): the probe's report and the Adam step after
    it, with copies or without."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = tiny_lm()
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=1, mp_policy=MixedPrecisionPolicy())
    fully_shard(model, mp_policy=MixedPrecisionPolicy())
    engine = adam_engine(model, "bookkeeping", ctx)
    with contextlib.nullcontext() if copies else without_copies():
        table = engine.verify(make_batch, probe_loss).table()
    step = moves(model, engine, token_ids()[ctx.shard(N)])
    engine.detach()
    return {"table": table, "step": step}


def worker(out: Path) -> None:
    from dptext.finetune.distributed import current, release

    ctx = current("cpu")
    ctx.sharded = True
    results = {(mode, keep): probed(mode, ctx, keep, adam_engine) for mode in MODES for keep in (True, False)}
    results["chosen"] = chosen(ctx)
    results["shard_write"] = copies_after_a_shard_write(ctx)
    results["smaller_mesh"] = {copies: smaller_mesh_after_forward(ctx, copies) for copies in (True, False)}
    results["writing"] = {"adam": writing(ctx, torch.optim.Adam)}
    with without_copies():
        results["writing"]["adam_without_copies"] = writing(ctx, torch.optim.Adam)
    torch.save(results, out / f"rank{ctx.rank}.pt")
    release()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_two_ranks(__file__, tmp_path_factory.mktemp("ranks"), TIMEOUT)


def test_the_budget_is_the_optimizer_state_the_first_step_allocates():
    from dptext.privacy.proof.cached_gathers import state_budget, state_per_parameter

    params = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))]
    adam, amsgrad = torch.optim.Adam(params), torch.optim.AdamW(params, amsgrad=True)
    assert state_per_parameter(adam, adam.param_groups[0]) == 2
    assert state_per_parameter(amsgrad, amsgrad.param_groups[0]) == 3
    assert state_budget(adam) == 2 * (12 * 4 + 5 * 8)
    assert state_budget(torch.optim.SGD(params, lr=1)) == 0
    assert state_budget(torch.optim.SGD(params, lr=1, momentum=0.9)) == 12 * 4 + 5 * 8
    assert state_budget(torch.optim.RMSprop(params)) == 0  # not known here: nothing beyond the root
    assert state_budget(None) == 0


def test_units_are_copied_while_the_root_and_they_fit_the_budget(two_ranks):
    for rank in two_ranks:
        assert rank["chosen"] == {"adam": ["blocks.0", "blocks.1"], "sgd": [], "momentum": [], "rmsprop": []}


def test_a_copy_is_not_used_once_a_shard_changed_even_through_data(two_ranks):
    for rank in two_ranks:
        (first, out0), (second, out1), (third, out2), (fourth, out3) = rank["shard_write"]
        assert (first, second, third, fourth) == (3, 0, 1, 0)  # every unit, none, the written block again, none
        torch.testing.assert_close(out1, out0, rtol=0, atol=0)
        assert not torch.equal(out2, out1)  # the write reached the forward, as a fresh all-gather gives it
        torch.testing.assert_close(out3, out2, rtol=0, atol=0)


def test_blocks_resharded_to_a_smaller_mesh_after_their_forward_are_proven_as_without_copies(two_ranks):
    # a unit resharded after its forward to a smaller mesh gathers its backward's weights from that reshard (which
    # keeps what its forward wrote): the copies serve only gathers from the fully sharded state
    for rank in two_ranks:
        got, before = rank["smaller_mesh"][True], rank["smaller_mesh"][False]
        assert got["table"] == before["table"] and {row["status"] for row in got["table"]} == {"exact"}
        for name, move in before["step"].items():
            torch.testing.assert_close(got["step"][name], move, rtol=0, atol=0)


def gathers(result: dict, shape: int, phase: str) -> int:
    return sum(count for (each, name, _), count in result["gathers"].items() if each == shape and name == phase)


@pytest.mark.parametrize("mode", MODES)
def test_with_adam_every_unit_is_all_gathered_once_for_the_whole_probe(two_ranks, mode):
    for rank in two_ranks:
        got, before = rank[(mode, True)], rank[(mode, False)]
        per_unit = {}
        for (_, _, unit), count in got["gathers"].items():
            per_unit[unit] = per_unit.get(unit, 0) + count
        assert per_unit == {"root": 1, "blocks.0": 1, "blocks.1": 1}, got["gathers"]
        assert gathers(got, 0, "other") == 3  # all three in the first shape's engine pass
        assert sum(before["gathers"].values()) > 10, before["gathers"]


@pytest.mark.parametrize("mode", MODES)
def test_copied_gathers_change_neither_the_proof_nor_the_adam_step_after_it(two_ranks, mode):
    for rank in two_ranks:
        got, before = rank[(mode, True)], rank[(mode, False)]
        assert got["table"] == before["table"]
        assert {row["status"] for row in got["table"]} == {"exact"}
        assert got["resharded"] and got["settings"] == before["settings"]
        assert all(flag for flag, _ in got["settings"])
        for name, move in before["step"].items():
            torch.testing.assert_close(got["step"][name], move, rtol=0, atol=0)


def test_a_forward_writing_into_its_gathered_weights_gets_what_training_gives_it(two_ranks):
    # the write lands in the gathered storage, which FSDP2 frees when it gives the unit back: with a copy serving
    # the next gather as without one (the copy is taken from the all-gather, before any forward ran)
    for rank in two_ranks:
        assert rank["writing"]["adam"] == rank["writing"]["adam_without_copies"], rank["writing"]
        assert rank["writing"]["adam"][0] == "ok", rank["writing"]


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
