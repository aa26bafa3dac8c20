"""The sharded probe's per-example work shared by the ranks (``independence.redraws_of_this_rank``,
``reference.shared_examples``): each re-drawn example and each compared example's backward pass runs on one rank,
so the probe's passes per rank fall with the ranks as a step's share of the batch does (issue 42). 2 gloo processes.

Checked: how the examples are dealt out (every rank the same number of passes, each example on one rank); on two
ranks each rank re-draws three of the first shape's five examples and two of the second's four, and takes one
backward pass of the reference where it took two; the verdicts equal the one-process probe's (the reference summed
over the ranks compares exactly); a mix that only the re-draw of example 3 shows (rank 1's) and rows of a layer
input that only that re-draw moves, or a mix only in bf16 (FSDP2's bf16 policy: the re-draws in the training
precision, shared alike), are refused on both ranks with the same report.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from fsdp_models import VOCAB, TinyLM, shard
from test_fsdp_probe import engine_for, make_batch, probe_loss
from test_fsdp_redteam import outcome
from two_ranks import run_two_ranks

from dptext.privacy.proof.independence import redraws_of_this_rank
from dptext.privacy.proof.reference import shared_examples

TIMEOUT = 240


def test_every_example_is_redrawn_on_one_rank_and_every_rank_runs_as_many_passes():
    for examples in (1, 2, 4, 5, 7):
        for world_size in (1, 2, 3, 8):
            passes = [redraws_of_this_rank(examples, rank, world_size) for rank in range(world_size)]
            assert len({len(each) for each in passes}) == 1  # each pass is a collective
            assert len(passes[0]) == -(-examples // world_size)
            assert {example for each in passes for example in each} == set(range(examples))
    assert redraws_of_this_rank(5, 0, 2) == [0, 2, 4] and redraws_of_this_rank(5, 1, 2) == [1, 3, 1]


def test_the_compared_examples_are_counted_once_and_every_rank_takes_a_backward_pass():
    for world_size in (1, 2, 3, 4):
        shares = [shared_examples([0, 3], rank, world_size) for rank in range(world_size)]
        counted = [example for own, _ in shares for example in own]
        assert sorted(counted) == [0, 3]  # each compared example on one rank
        passes = {len(own) + (uncounted is not None) for own, uncounted in shares}
        assert passes == {-(-2 // world_size)}, shares  # as many backward passes everywhere
        for own, uncounted in shares:
            assert uncounted is None or uncounted not in own


class MixedByExample3(TinyLM):
    """Example 0's hidden state takes example 3's: only re-drawing example 3 moves another example's loss."""

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        if hidden.shape[0] > 3:
            hidden = torch.cat([hidden[:1] + 0.5 * hidden[3:4].detach(), hidden[1:]])  # (no gradient: only
            # the re-draws can see it)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


class SideMixedByExample3(TinyLM):
    """A side layer whose input row 0 takes example 3's; its output reaches no loss: only its recorded rows move
    (a refusal of that layer alone, found where example 3 is re-drawn)."""

    def __init__(self):
        super().__init__()
        self.side = nn.Linear(6, 6)

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        if hidden.shape[0] > 3:
            self.side(torch.cat([hidden[:1] + hidden[3:4], hidden[1:]]))
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


class MixedByExample3InBf16(TinyLM):
    """Example 3's hidden state moves example 0's only where the forward computes in bf16 (FSDP2's bf16 policy):
    only the re-draws in the training precision, example 3's on rank 1, can see it."""

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        if hidden.dtype == torch.bfloat16 and hidden.shape[0] > 3:
            hidden = torch.cat([hidden[:1] + 0.5 * hidden[3:4].detach(), hidden[1:]])
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


KINDS = {"tiny": TinyLM, "mixed_by_3": MixedByExample3, "side_by_3": SideMixedByExample3,
         "bf16_by_3": MixedByExample3InBf16}


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return KINDS[kind]().double()


def report_of(kind: str, ctx=None) -> tuple:
    """("ok" or "refused", the probe's statuses per layer, its loss problem) and the passes it made: re-drawn
    examples per probe shape, and the reference's backward passes."""
    from dptext.privacy.proof import independence, reference

    redrawn, backward = [], [0]
    real_rows, real_gradient = independence._moved_rows, reference._example_gradient

    def rows(before, after, keep, examples, close):
        redrawn.append((examples, int((~keep).nonzero()[0])))
        return real_rows(before, after, keep, examples, close)

    def gradient(*args, **kwargs):
        backward[0] += 1
        return real_gradient(*args, **kwargs)

    independence._moved_rows, reference._example_gradient = rows, gradient
    try:
        model = build(kind)
        if kind == "bf16_by_3":  # gathered in bf16 by FSDP2's policy (sharded), in bf16 autocast (one process)
            from torch.distributed.fsdp import MixedPrecisionPolicy

            from dptext.finetune.sharding import shard_model

            if ctx is not None:
                shard_model(model, list(model.blocks), MixedPrecisionPolicy(param_dtype=torch.bfloat16))
            else:
                model = model.to(torch.bfloat16)
        else:
            model = shard(model, ctx)
        engine = engine_for(model, "bookkeeping", ctx)
        report = {}

        def prove():
            from dptext.privacy.proof.verify import probe

            got = probe(engine, make_batch, probe_loss)
            report.update(table={row["name"]: row["status"] for row in got.table()}, loss=got.loss_problem)
            got.raise_if_refused()

        verdict, _ = outcome(prove)
        engine.detach()
    finally:
        independence._moved_rows, reference._example_gradient = real_rows, real_gradient
    return verdict, report.get("table"), report.get("loss"), redrawn, backward[0]


def worker(out: Path) -> None:
    from dptext.finetune.distributed import current, release

    ctx = current("cpu")
    ctx.sharded = True
    torch.save({kind: report_of(kind, ctx) for kind in KINDS}, out / f"rank{ctx.rank}.pt")
    release()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_two_ranks(__file__, tmp_path_factory.mktemp("ranks"), TIMEOUT)


def test_each_rank_redraws_its_share_and_takes_one_backward_pass_of_the_reference(two_ranks):
    one_process = report_of("tiny")
    assert [examples for examples, _ in one_process[3]] == [5] * 5 + [4] * 4
    assert one_process[4] == 4  # two compared examples at each of the two shapes
    for rank, got in enumerate(two_ranks):
        verdict, table, _, redrawn, backward = got["tiny"]
        assert verdict == "ok" and table == one_process[1]  # the summed reference compares as in one process
        assert redrawn == [(5, e) for e in redraws_of_this_rank(5, rank, 2)] + \
            [(4, e) for e in redraws_of_this_rank(4, rank, 2)]
        assert backward == 2


@pytest.mark.parametrize("kind", ["mixed_by_3", "side_by_3", "bf16_by_3"])
def test_a_mix_only_rank_1s_redraw_shows_is_refused_on_both_ranks_alike(two_ranks, kind):
    single = report_of(kind)
    assert single[0] == "refused"
    first, second = two_ranks[0][kind], two_ranks[1][kind]
    assert first[0] == second[0] == "refused"
    assert first[1] == second[1] and first[2] == second[2]  # the same report on both ranks
    assert (first[2] is None) == (single[2] is None)
    if kind == "side_by_3":
        assert first[1]["side"] == "refused" and first[2] is None, first
    if kind == "bf16_by_3":
        assert "in the precision training runs in (bfloat16)" in first[2], first


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
