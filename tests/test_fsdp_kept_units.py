"""The sharded probe keeps FSDP2 units gathered between its passes within the optimizer-state budget (issue 42,
``dptext/privacy/proof/kept_units.py``): 2 gloo processes.

With Adam (two moments per parameter: a rank's share of them is as large as the whole gathered model on 2 ranks)
every unit stays gathered from pass to pass: FSDP2 gathers each unit once for the first shape's engine pass and
once more after the engine's backward gave them back, never for the re-draws or the whole-model forward. Against
the probe with nothing kept: the same report, the same (noise-free Adam) step after it, every unit resharded and
FSDP2's settings put back. A forward that writes into a kept unit's gathered weights in place is refused in one
sentence. With SGD (no state) only the root is kept, as before.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
from fsdp_models import N, losses, shard, tiny_lm, token_ids
from test_fsdp_probe import make_batch, probe_loss
from test_fsdp_probe_gathers import counted_gathers, nothing_kept, settings
from test_fsdp_redteam import outcome
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


def adam_moves(model, engine, ids) -> dict:
    before = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    engine.accumulate(losses(model, ids))
    engine.step()
    return {name: p.full_tensor().detach() - before[name] for name, p in model.named_parameters()}


def probed(mode: str, ctx, keep: bool) -> dict:
    model = shard(tiny_lm(), ctx)
    engine = adam_engine(model, mode, ctx)
    with (contextlib.nullcontext() if keep else nothing_kept()), counted_gathers() as counts:
        table = engine.verify(make_batch, probe_loss).table()
    resharded = all(hasattr(param, "to_local") for param in model.parameters())
    after = [(flag, info is None) for flag, info in settings(model)]
    step = adam_moves(model, engine, token_ids()[ctx.shard(N)])
    engine.detach()
    return {"table": table, "gathers": dict(counts), "resharded": resharded, "settings": after, "step": step}


def chosen(ctx) -> dict:
    """Which units ``units_within_budget`` keeps besides the root, per optimizer."""
    from dptext.privacy.proof.kept_units import state_budget, units_within_budget

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


def worker(out: Path) -> None:
    from dptext.finetune.distributed import current, release

    ctx = current("cpu")
    ctx.sharded = True
    results = {(mode, keep): probed(mode, ctx, keep) for mode in MODES for keep in (True, False)}
    results["chosen"] = chosen(ctx)
    results["writing"] = {"adam": writing(ctx, torch.optim.Adam),
                          "sgd": writing(ctx, lambda params, lr: torch.optim.SGD(params, lr=lr))}
    torch.save(results, out / f"rank{ctx.rank}.pt")
    release()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_two_ranks(__file__, tmp_path_factory.mktemp("ranks"), TIMEOUT)


def test_the_budget_is_the_optimizer_state_the_first_step_allocates():
    from dptext.privacy.proof.kept_units import state_budget, state_per_parameter

    params = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))]
    adam, amsgrad = torch.optim.Adam(params), torch.optim.AdamW(params, amsgrad=True)
    assert state_per_parameter(adam, adam.param_groups[0]) == 2
    assert state_per_parameter(amsgrad, amsgrad.param_groups[0]) == 3
    assert state_budget(adam) == 2 * (12 * 4 + 5 * 8)
    assert state_budget(torch.optim.SGD(params, lr=1)) == 0
    assert state_budget(torch.optim.SGD(params, lr=1, momentum=0.9)) == 12 * 4 + 5 * 8
    assert state_budget(torch.optim.RMSprop(params)) == 0  # not known here: nothing beyond the root
    assert state_budget(None) == 0


def test_units_are_kept_while_the_root_and_they_fit_the_budget(two_ranks):
    for rank in two_ranks:
        assert rank["chosen"] == {"adam": ["blocks.0", "blocks.1"], "sgd": [], "momentum": [], "rmsprop": []}


def gathers(result: dict, shape: int, phase: str) -> int:
    return sum(count for (each, name, _), count in result["gathers"].items() if each == shape and name == phase)


@pytest.mark.parametrize("mode", MODES)
def test_with_adam_every_unit_is_gathered_twice_at_the_first_shape_and_never_for_the_redraws(two_ranks, mode):
    for rank in two_ranks:
        got, before = rank[(mode, True)], rank[(mode, False)]
        units = 3  # the root and two blocks
        passes = 2 if mode == "ghost" else 1  # ghost's second backward gathers again after its first resharded
        assert gathers(got, 0, "other") == units * passes  # the engine's forward (kept through its backward)
        assert gathers(got, 0, "reference_gradients") == units  # after the engine's backward gave them back
        assert gathers(got, 0, "check_redrawn_examples") == 0
        assert gathers(got, 0, "check_whole_forward") == 0  # runs before the cut, on the kept units
        assert gathers(before, 0, "check_redrawn_examples") > 0 and gathers(before, 0, "check_whole_forward") > 0
        assert sum(got["gathers"].values()) < sum(before["gathers"].values()) / 2, (got["gathers"], before["gathers"])


@pytest.mark.parametrize("mode", MODES)
def test_keeping_units_changes_neither_the_proof_nor_the_adam_step_after_it(two_ranks, mode):
    for rank in two_ranks:
        got, before = rank[(mode, True)], rank[(mode, False)]
        assert got["table"] == before["table"]
        assert {row["status"] for row in got["table"]} == {"exact"}
        assert got["resharded"] and got["settings"] == before["settings"]
        assert all(flag for flag, _ in got["settings"])
        for name, move in before["step"].items():
            torch.testing.assert_close(got["step"][name], move, rtol=0, atol=0)


def test_a_forward_writing_into_kept_weights_is_refused_and_not_kept_ones_as_before(two_ranks):
    for rank in two_ranks:
        status, message = rank["writing"]["adam"]
        assert status == "refused" and "writes into the gathered weights of 'blocks.1' in place" in message
        assert rank["writing"]["sgd"][0] == "ok", rank["writing"]["sgd"]  # only the root kept: gathered afresh


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
