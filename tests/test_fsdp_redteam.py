"""Red-team checks of FSDP2's chunked reduce-scatter (issue 42): 2 gloo processes against the single-process engine.

One launch (this file run as a script with torchrun's environment) runs every case on the tiny fp64 models of
``fsdp_models``; the tests here compare with single-process twins. Covered: a parameter with fewer rows than ranks
(rank 1 owns none of it), the step's bound over every rank's rows (C shrunk after clipping: refused on both ranks,
both layouts, book-keeping and per_sample), a non-finite example on one rank and a per_sample micro-batch refused
on one rank (refused on both, no hang), LoRA-shaped adapters beside frozen layers a layer per chunk in both
layouts, a layer unfrozen by ``replan()`` after the engine was built, FSDP2 sharding a weight on dim 1
(``shard_placement_fn``), and what a user changes after the engine was built (``fsdp_changes``: a layer frozen, a
foreign backward pass or optimizer step, a parameter replaced, a global hook), refused on both ranks as in one process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from fsdp_changes import (CHANGES, DELTA, FREEZES, FROZEN, SIGMA, changed_after_the_engine, class_round_trip,
                          frozen_after_the_engine)
from fsdp_models import N, VOCAB, TinyLM, full, losses, shard, tiny_lm, token_ids
from test_fsdp import refused_on_one_rank
from two_ranks import FAILURES, run_two_ranks

C = 0.5
TIMEOUT = 240
MODES = ("bookkeeping", "per_sample")


class NarrowHead(TinyLM):
    """A layer of one output (``Linear(6, 1)``: weight 1 × 6, bias 1) shifting the embeddings: under 2 ranks rank 1
    owns none of its rows."""

    def __init__(self):
        super().__init__()
        self.narrow = nn.Linear(6, 1)

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        hidden = hidden + self.narrow(hidden)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def narrow_lm() -> nn.Module:
    torch.manual_seed(0)
    return NarrowHead().double()


class Adapted(TinyLM):
    """LoRA's shape by hand: each block's ``fc`` frozen, a trainable rank-2 adapter (down 2 × 6, up 6 × 2) beside
    it; the tied embedding and head trained."""

    def __init__(self):
        super().__init__()
        self.down = nn.ModuleList([nn.Linear(6, 2, bias=False) for _ in self.blocks])
        self.up = nn.ModuleList([nn.Linear(2, 6, bias=False) for _ in self.blocks])
        for block in self.blocks:
            block.fc.requires_grad_(False)

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        for block, down, up in zip(self.blocks, self.down, self.up):
            hidden = block(hidden) + up(down(hidden))
        return self.head(hidden)


def adapted_update(layout, ctx=None, rows=None):
    """Book-keeping on ``Adapted`` with one whole layer per chunk (the chunk size forced to 1 coordinate)."""
    from dptext.privacy.sharding import row_reduce

    torch.manual_seed(0)
    model = Adapted().double()
    if ctx is not None:
        from dptext.finetune.sharding import shard_model

        shard_model(model, list(model.blocks))  # the adapters go to the root unit
    real, row_reduce.CHUNK_COORDINATES = row_reduce.CHUNK_COORDINATES, 1
    try:
        return moves(model, engine_for(model, layout=layout, ctx=ctx),
                     token_ids()[rows if rows is not None else slice(None)])
    finally:
        row_reduce.CHUNK_COORDINATES = real


def engine_for(model, mode="bookkeeping", layout="all_layer", ctx=None):
    from dptext.privacy import PrivacyEngine

    return PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0, max_grad_norm=C,
                         expected_batch_size=N, dataset_size=N, clipping_mode=mode, clipping_layout=layout,
                         distributed=ctx, verify=False)


def moves(model, engine, ids) -> dict:
    """One noise-free SGD step (lr 1) on ``ids``: each parameter's move, gathered."""
    before = {name: full(p).detach().clone() for name, p in model.named_parameters()}
    engine.accumulate(losses(model, ids))
    engine.step()
    return {name: full(p).detach() - before[name] for name, p in model.named_parameters()}


def outcome(action):
    """("ok", value) or ("refused", message) for a UserError; any other error propagates (the worker fails)."""
    from dptext.errors import UserError

    try:
        return "ok", action()
    except UserError as error:
        return "refused", str(error)


def narrow_update(mode, ctx=None, rows=None):
    model = shard(narrow_lm(), ctx)
    return moves(model, engine_for(model, mode, ctx=ctx), token_ids()[rows if rows is not None else slice(None)])


def shrunk_bound(ctx, mode, layout):
    """C shrunk after clipping (as a wrong rule would leave too large a sum): the step's bound must refuse."""
    model = shard(tiny_lm(), ctx)
    engine = engine_for(model, mode, layout, ctx)
    engine.accumulate(losses(model, token_ids()[ctx.shard(N)]))
    engine.dp_optimizer.max_grad_norm = C / 100
    engine.step()


def non_finite_on_rank_1(ctx, mode):
    model = shard(tiny_lm(), ctx)
    engine = engine_for(model, mode, ctx=ctx)
    loss = losses(model, token_ids()[ctx.shard(N)])
    if ctx.rank == 1:
        loss = loss * torch.tensor([float("inf")] + [1.0] * (loss.numel() - 1), dtype=loss.dtype)
    engine.accumulate(loss)
    engine.step()


def unfrozen_update(mode, ctx=None, rows=None):
    """blocks.1.fc frozen when the engine is built, unfrozen and ``replan()``-ed before the first step."""
    model = shard(tiny_lm(), ctx)
    layer = model.blocks[1].fc
    layer.requires_grad_(False)
    engine = engine_for(model, mode, ctx=ctx)
    layer.requires_grad_(True)
    engine.replan(verify=False)
    return moves(model, engine, token_ids()[rows if rows is not None else slice(None)])


def dim1_update(ctx=None, rows=None):
    """The blocks' square weights sharded on dim 1 (``shard_placement_fn``), book-keeping."""
    model = tiny_lm()
    if ctx is not None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        for block in model.blocks:
            fully_shard(block, shard_placement_fn=lambda param: Shard(1) if param.ndim == 2 else None)
        fully_shard(model)
    return moves(model, engine_for(model, ctx=ctx), token_ids()[rows if rows is not None else slice(None)])


def probe_sharded(ctx, mode: str):
    """The start-up probe asked for on an already-sharded model runs there, every rank together
    (``proof.sharded_probe``; the cases are in test_fsdp_probe.py): the statuses of its report."""
    model = shard(tiny_lm(), ctx)
    report = engine_for(model, mode, ctx=ctx).verify(
        make_batch=lambda b, t, generator: {"input_ids": torch.randint(0, VOCAB, (b, t), generator=generator)},
        loss_fn=lambda model, batch: losses(model, batch["input_ids"]))
    return sorted({row["status"] for row in report.table()})


def proof_carried(ctx, mode: str) -> dict:
    """Proven before fully_shard (report = engine.verify()), then the engine on the sharded model takes it
    (verify=report): verified, not flagged in mechanism(), and it trains."""
    from dptext.privacy import PrivacyEngine

    model = tiny_lm()
    before = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0,
                           max_grad_norm=C, expected_batch_size=N, dataset_size=N, clipping_mode=mode)
    report = before.verify(make_batch=lambda b, t, generator: {"input_ids": torch.randint(0, VOCAB, (b, t),
                                                                                          generator=generator)},
                           loss_fn=lambda model, batch: losses(model, batch["input_ids"]))
    before.detach()
    shard(model, ctx)
    engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                           max_grad_norm=C, expected_batch_size=N, dataset_size=N, clipping_mode=mode,
                           distributed=ctx, verify=report)
    engine.step(losses(model, token_ids()[ctx.shard(N)]))
    return {"verified": engine.verified, "mechanism": str(engine.mechanism()), "steps": engine.steps}


def worker(out: Path) -> None:
    from dptext.finetune.distributed import current, release

    ctx = current("cpu")
    ctx.sharded = True
    mine = ctx.shard(N)
    results = {
        "narrow": {mode: narrow_update(mode, ctx, mine) for mode in (*MODES, "ghost")},
        "bound": {(mode, layout): outcome(lambda: shrunk_bound(ctx, mode, layout))
                  for mode in MODES for layout in ("all_layer", "per_layer")},
        "non_finite": {mode: outcome(lambda: non_finite_on_rank_1(ctx, mode)) for mode in MODES},
        "unfrozen": {mode: outcome(lambda: unfrozen_update(mode, ctx, mine)) for mode in MODES},
        "dim1": outcome(lambda: dim1_update(ctx, mine)),
        "probe_sharded": {mode: outcome(lambda: probe_sharded(ctx, mode)) for mode in (*MODES, "ghost")},
        "refused": {failure: refused_on_one_rank(ctx, "per_sample", failure) for failure in FAILURES},
        "adapted": {layout: adapted_update(layout, ctx, mine) for layout in ("all_layer", "per_layer")},
        "frozen": {case: frozen_after_the_engine(ctx, *case) for case in FREEZES},
        "round_trip": class_round_trip(ctx),
        "changed": {(mode, change): changed_after_the_engine(ctx, mode, change)
                    for mode in (*MODES, "ghost") for change in CHANGES},
        "first_rank": proved_on_first_rank(),
        "carried": {mode: proof_carried(ctx, mode) for mode in (*MODES, "ghost")},
    }
    torch.save(results, out / f"rank{ctx.rank}.pt")
    release()


PROBE_REFUSAL = "The start-up probe refused layer 'fc' (Linear): a test's refusal."


def proved_on_first_rank() -> dict:
    """finetune's ``on_first_rank``: which ranks ran the proof, and each rank's outcome of a refusing one."""
    from dptext.errors import UserError
    from dptext.finetune.sharding import on_first_rank

    ran: list[int] = []
    outcome_ok = outcome(lambda: on_first_rank(lambda: ran.append(torch.distributed.get_rank())))

    def refuse() -> None:
        raise UserError(PROBE_REFUSAL)

    return {"ran": ran, "ok": outcome_ok, "refused": outcome(lambda: on_first_rank(refuse))}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_two_ranks(__file__, tmp_path_factory.mktemp("ranks"), TIMEOUT)


def assert_same(got: dict, single: dict, what: str) -> None:
    assert sorted(got) == sorted(single)
    for name in single:
        assert torch.allclose(got[name], single[name], atol=1e-6, rtol=1e-5), \
            f"{what} {name}: off by {(got[name] - single[name]).abs().max():.3g}"


@pytest.mark.parametrize("mode", (*MODES, "ghost"))
def test_a_parameter_with_fewer_rows_than_ranks_is_summed_as_in_one_process(two_ranks, mode):
    single = narrow_update(mode)
    assert single["narrow.weight"].abs().max() > 0
    for rank in two_ranks:
        assert_same(rank["narrow"][mode], single, mode)


@pytest.mark.parametrize("layout", ["all_layer", "per_layer"])
@pytest.mark.parametrize("mode", MODES)
def test_the_step_checks_the_bound_over_every_ranks_rows(two_ranks, mode, layout):
    for rank in two_ranks:
        verdict, message = rank["bound"][(mode, layout)]
        assert verdict == "refused" and "per-step privacy check failed" in message


@pytest.mark.parametrize("mode", MODES)
def test_a_non_finite_example_on_one_rank_is_refused_on_both(two_ranks, mode):
    for rank in two_ranks:
        verdict, message = rank["non_finite"][mode]
        assert verdict == "refused" and "per-step privacy check failed" in message, message


@pytest.mark.parametrize("failure", FAILURES)
def test_per_sample_refused_on_one_rank_refuses_on_both_without_a_hang(two_ranks, failure):
    # the refusing rank joins every chunk's reduce-scatter with zeros (join_reduction), or the other waits for ever
    for rank in two_ranks:
        assert rank["refused"][failure]["unchanged"] and rank["refused"][failure]["refusal"]
    assert FAILURES[failure] in two_ranks[1]["refused"][failure]["refusal"]


@pytest.mark.parametrize("layout", ["all_layer", "per_layer"])
def test_adapters_beside_frozen_layers_one_layer_per_chunk_are_summed_as_in_one_process(two_ranks, layout):
    single = adapted_update(layout)
    assert single["up.0.weight"].abs().max() > 0 and not single["blocks.0.fc.weight"].any()
    for rank in two_ranks:
        assert_same(rank["adapted"][layout], single, layout)


@pytest.mark.parametrize("mode", MODES)
def test_a_layer_unfrozen_by_replan_is_trained_under_fsdp2(two_ranks, mode):
    single = unfrozen_update(mode)
    assert single["blocks.1.fc.weight"].abs().max() > 0
    for rank in two_ranks:
        verdict, got = rank["unfrozen"][mode]
        assert verdict == "ok", got
        assert_same(got, single, mode)


@pytest.mark.parametrize("mode", [*MODES, "ghost"])
def test_the_probe_on_a_sharded_model_proves_it_on_every_rank(two_ranks, mode):
    for rank in two_ranks:
        verdict, statuses = rank["probe_sharded"][mode]
        assert verdict == "ok" and statuses == ["exact"], statuses


@pytest.mark.parametrize("mode", [*MODES, "ghost"])
def test_a_proof_made_before_fully_shard_is_carried_to_the_sharded_engine(two_ranks, mode):
    for rank in two_ranks:
        got = rank["carried"][mode]
        assert got["verified"] and got["steps"] == 1 and "NOT VERIFIED" not in got["mechanism"], got


def test_a_weight_sharded_on_dim_1_is_refused(two_ranks):
    # row_reduce reduces by rows: a weight sharded on dim 1 (shard_placement_fn) would get rows of the clipped sum as
    # its columns, a silently wrong update, so the engine refuses it when built
    for rank in two_ranks:
        verdict, got = rank["dim1"]
        assert verdict == "refused" and "Shard(0)" in str(got), got


@pytest.mark.parametrize("case", FREEZES, ids=["-".join(case) for case in FREEZES])
def test_a_layer_frozen_after_the_engine_is_refused_then_left_alone_under_fsdp2(two_ranks, case):
    from dptext.accounting import StepRun, compute_epsilon

    for rank in two_ranks:
        got = rank["frozen"][case]
        before, refused, after = got["before"], got["refused"], got["after"]
        assert "was frozen after the privacy engine planned" in refused["refusal"], refused["refusal"]
        assert FROZEN in refused["refusal"]
        assert all(torch.equal(refused["unchanged"][name], before[name]) for name in before)  # nothing applied
        assert refused["steps"] == 0 and got["still_frozen"]
        for name in before:  # after replan() and a noisy step: the frozen layer bit-identical, every other one moved
            assert torch.equal(after[name], before[name]) == name.startswith(FROZEN), name
        expected = compute_epsilon("rdp", [StepRun(got["sample_rate"], SIGMA, 1)], DELTA).guaranteed
        assert got["steps"] == 1 and got["epsilon"] == expected  # the refused step was not accounted
    first, second = (rank["frozen"][case]["after"] for rank in two_ranks)
    assert all(torch.equal(first[name], second[name]) for name in first)  # one model on both ranks


def test_the_engines_dtensor_class_stays_with_the_engine(two_ranks):
    for rank in two_ranks:
        got = rank["round_trip"]
        assert got["planned_class"] == "EngineDTensor"
        assert got["copy"] and got["pickle"] and got["detached"] and got["freeze_kept"], got


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("mode", (*MODES, "ghost"))
def test_a_change_after_the_engine_is_refused_on_both_ranks_as_in_one_process(two_ranks, mode, change):
    for rank in two_ranks:
        got = rank["changed"][(mode, change)]
        assert CHANGES[change][1] in got["refusal"], got["refusal"]
        assert got["unchanged"]
        if change == "foreign backward":  # dropped whole: the next step is a clean step, no raw gradient left
            assert any(delta.abs().max() > 0 for delta in got["next"].values())
            assert_same(got["next"], got["clean"], mode)


def test_rank_0_proves_for_both_ranks_and_its_refusal_stops_both(two_ranks):
    """Under train.sharding=fsdp the start-up proof runs on rank 0 only (the others hold no probe state and
    wait); a refusal there is the same sentence on every rank."""
    ranks = [rank["first_rank"] for rank in two_ranks]
    assert [got["ran"] for got in ranks] == [[0], []]
    assert all(got["ok"][0] == "ok" and got["refused"] == ("refused", PROBE_REFUSAL) for got in ranks)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    worker(Path(sys.argv[1]))
