"""What a user changes on an FSDP2 model after the privacy engine was built, refused on both ranks alike: 2 gloo
processes. FSDP2's ``set_unshard_in_backward(False)`` (``fsdp_controls.check_unshard_in_backward``): a unit left
sharded for its backward crashed every clipping mode with torch's raw RuntimeError ("data is not allocated":
book-keeping and per_sample's pass, ghost's first; ghost's second even on the root); now one sentence, before the
probe's first backward or the step's, and a run that turns it back on trains on, its step that of a run that never
changed it. A forward hook registered on rank 1 alone between the engine's construction and ``verify()``
(``step_checks.check_hooks_as_planned``): both ranks refuse, neither waits in the probe. An outside read under
ghost clipping on rank 1's data only: both ranks refuse at the step, nothing applied (rank 1 used to raise at once
and leave rank 0 waiting in the passes' collectives)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from fsdp_models import N, Block, full, losses, shard, tiny_lm, token_ids
from test_fsdp_probe import make_batch, probe_loss
from test_fsdp_redteam import engine_for, moves, outcome
from two_ranks import run_two_ranks

TIMEOUT = 240
MODES = ("bookkeeping", "ghost", "per_sample")
CASES = ("before_probe", "after_probe", "root_after_probe")


def unshard_off(ctx, mode: str, case: str) -> tuple:
    """The setting turned off on block 1 (or the root) before or after the probe: the refusal, then (turned back
    on) one noise-free step's moves."""
    model = shard(tiny_lm(), ctx)
    engine = engine_for(model, mode, ctx=ctx)
    unit = model if case.startswith("root") else model.blocks[1]
    if case == "before_probe":
        unit.set_unshard_in_backward(False)
        said = outcome(lambda: engine.verify(make_batch, probe_loss))
        unit.set_unshard_in_backward(True)
        engine.verify(make_batch, probe_loss)
    else:
        engine.verify(make_batch, probe_loss)
        unit.set_unshard_in_backward(False)
        said = outcome(lambda: engine.accumulate(losses(model, token_ids()[ctx.shard(N)])))
        unit.set_unshard_in_backward(True)
    return said, moves(model, engine, token_ids()[ctx.shard(N)])


def never_changed(ctx, mode: str) -> dict:
    model = shard(tiny_lm(), ctx)
    engine = engine_for(model, mode, ctx=ctx)
    engine.verify(make_batch, probe_loss)
    return moves(model, engine, token_ids()[ctx.shard(N)])


def hook_on_rank_1(ctx) -> tuple:
    model = shard(tiny_lm(), ctx)
    engine = engine_for(model, "bookkeeping", ctx=ctx)
    if ctx.rank == 1:
        model.blocks[1].fc.register_forward_hook(lambda *args: None)
    return outcome(lambda: engine.verify(make_batch, probe_loss))


class ReadsOnRequest(Block):
    """A block that, when ``read`` is set (standing for a data-dependent path taken on one rank's examples only),
    also reads its linear weight functionally, outside its layer (a path ghost clipping's norms do not see)."""

    read = False

    def forward(self, hidden):
        if self.read:
            hidden = hidden + torch.nn.functional.linear(hidden, self.fc.weight)
        return super().forward(hidden)


def outside_read_on_rank_1(ctx) -> tuple:
    """Ghost clipping, an outside read on rank 1's data only after the probe: rank 1 used to raise at once and
    leave rank 0 waiting in the passes' collectives (session-26 red team); now both refuse at the step, nothing
    applied."""
    model = tiny_lm()
    model.blocks[1].__class__ = ReadsOnRequest
    shard(model, ctx)
    engine = engine_for(model, "ghost", ctx=ctx)
    engine.verify(make_batch, probe_loss)
    model.blocks[1].read = ctx.rank == 1
    before = {name: full(p).detach().clone() for name, p in model.named_parameters()}

    def step():
        engine.accumulate(losses(model, token_ids()[ctx.shard(N)]))
        engine.step()

    said = outcome(step)
    moved = max(float((full(p).detach() - before[name]).abs().max()) for name, p in model.named_parameters())
    return said, moved


def worker(out: Path) -> None:
    from dptext.finetune.distributed import current, release

    ctx = current("cpu")
    ctx.sharded = True
    results = {"cases": {(mode, case): unshard_off(ctx, mode, case) for mode in MODES for case in CASES},
               "plain": {mode: never_changed(ctx, mode) for mode in MODES}, "hook_on_rank_1": hook_on_rank_1(ctx),
               "read_on_rank_1": outside_read_on_rank_1(ctx)}
    torch.save(results, out / f"rank{ctx.rank}.pt")
    release()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_two_ranks(__file__, tmp_path_factory.mktemp("ranks"), TIMEOUT)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_unshard_off_is_refused_in_one_sentence_on_both_ranks(two_ranks, mode, case):
    sentences = [rank["cases"][(mode, case)][0] for rank in two_ranks]
    assert sentences[0] == sentences[1], sentences
    verdict, sentence = sentences[0]
    assert verdict == "refused" and "set_unshard_in_backward(False)" in sentence, sentence
    assert sentence.count(". ") == 0 and sentence.endswith(".")
    assert ("'blocks.1'" if case != "root_after_probe" else "'FSDPTinyLM'") in sentence


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_turned_back_on_the_run_steps_as_if_never_changed(two_ranks, mode, case):
    for rank in two_ranks:
        got, expected = rank["cases"][(mode, case)][1], rank["plain"][mode]
        for name, move in expected.items():
            torch.testing.assert_close(got[name], move, rtol=1e-6, atol=1e-9)
        assert any(float(move.abs().max()) > 0 for move in expected.values())



def test_a_hook_added_before_verify_on_one_rank_is_refused_on_both(two_ranks):
    (verdict0, sentence0), (verdict1, sentence1) = [rank["hook_on_rank_1"] for rank in two_ranks]
    assert verdict0 == verdict1 == "refused", (sentence0, sentence1)
    assert sentence0.startswith("Forward hooks on another rank were added or removed") and "replan()" in sentence0
    assert sentence1.startswith("Forward hooks of layer 'blocks.1.fc' were added or removed")


def test_an_outside_read_on_one_ranks_data_refuses_the_step_on_both_ranks_without_a_hang(two_ranks):
    words = ("Another process's per-step privacy check failed", "read outside the layers that own it")
    for rank, expected in zip(two_ranks, words):  # rank 1 names the read; rank 0 learns that another one failed
        (verdict, sentence), moved = rank["read_on_rank_1"]
        assert verdict == "refused" and expected in sentence, sentence
        assert moved == 0.0


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
