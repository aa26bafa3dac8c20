"""Red team of the sharded probe's per-example work shared by the ranks (issue 42: ``redraws_of_this_rank``,
``shared_examples``). 2 gloo processes (and 3 for the dealing out).

Where every rank ran every pass, a model or loss that fails on one example failed on every rank at the same pass;
shared, it fails on one rank only, and that rank left the collectives the others were waiting in. Found and fixed:
- a loss of fewer entries than the batch (shape (1,), refused for its shape): the compared examples were dealt out
  before the loss's length was known, so rank 0 took a backward pass of loss[0] and rank 1 none (example 1 has no
  entry): rank 0 waited for ever where the old probe refused on both;
- a model whose backward fails for example 1 only with another error than RuntimeError (a ValueError): rank 1
  raised it, rank 0 waited at the vote for ever (the old probe: both refused, "could not run this model");
- a forward that fails on one re-drawn batch only (example 3's, rank 1's share): rank 1 raised, rank 0 went on to
  its next re-draw and waited for ever;
- a RuntimeError in example 1's backward: rank 1 named it, rank 0 said "on another rank" (different refusals).
Each failure is now raised on every rank alike, the first failing rank's (``sharded_probe.raise_on_every_rank``).
A failure inside a pass before that pass's last collective (an error in the head's backward, first in backward
order) still leaves the other ranks waiting: sharing cannot avoid that, and it is not pinned here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from fsdp_models import TinyLM, losses, shard
from test_fsdp_probe import engine_for, make_batch, probe_loss
from test_fsdp_redteam import outcome
from two_ranks import CASES_VARIABLE, run_two_ranks

TIMEOUT = 120  # a hang fails the test (the cases take seconds)


class FailsForExample1(torch.autograd.Function):
    """Identity whose backward raises where only example 1's loss is differentiated: the reference's backward
    pass of example 1 (the engine's pass differentiates examples 0 and 1 together)."""

    @staticmethod
    def forward(ctx, hidden):
        return hidden.clone()

    @staticmethod
    def backward(ctx, grad):
        if grad.shape[0] > 1 and not bool(grad[0].any()) and bool(grad[1].any()):
            raise ERRORS[CASE[0]]("the backward of example 1")
        return grad


class BackwardFailsForExample1(TinyLM):
    def forward(self, input_ids):
        hidden = FailsForExample1.apply(self.embed(input_ids))  # last in backward order: after every collective
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


class FailsOnRedraw3(TinyLM):
    """Raises once the blocks ran (their gathers done) where example 3 of the first shape's batch is re-drawn:
    rank 1's share on two ranks."""

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        first = make_batch(5, 3, torch.Generator().manual_seed(0))["input_ids"]
        if input_ids.shape == first.shape and torch.equal(input_ids[:3], first[:3]) \
                and not torch.equal(input_ids[3], first[3]):
            raise ValueError("re-drawn example 3")
        return self.head(hidden)


def one_entry_loss(model, batch):
    """Not one loss per example: the batch's sum as a (1,) tensor (refused for its shape)."""
    return losses(model, batch["input_ids"]).sum().reshape(1)


ERRORS = {"backward_value_error": ValueError, "backward_runtime_error": RuntimeError}
CASE = [""]
CASES = {"one_entry_loss": (TinyLM, one_entry_loss), "backward_value_error": (BackwardFailsForExample1, probe_loss),
         "backward_runtime_error": (BackwardFailsForExample1, probe_loss), "redraw_fails": (FailsOnRedraw3, probe_loss)}


def verdict(case: str, ctx=None) -> tuple:
    """("ok" or "refused", the table or the refusal's words) of the probe on ``case``'s model."""
    from dptext.privacy.proof.verify import probe

    CASE[0] = case
    kind, loss_fn = CASES[case]
    torch.manual_seed(0)
    engine = engine_for(shard(kind().double(), ctx), "bookkeeping", ctx)

    def prove():
        report = probe(engine, make_batch, loss_fn)
        report.raise_if_refused()
        return {row["name"]: row["status"] for row in report.table()}

    try:
        return outcome(prove)
    finally:
        engine.detach()


def worker(out: Path) -> None:
    from dptext.finetune.distributed import current, release

    ctx = current("cpu")
    ctx.sharded = True
    got = {}
    for case in os.environ[CASES_VARIABLE].split(","):
        got[case] = verdict(case, ctx)
        torch.save(got, out / f"rank{ctx.rank}.pt")  # (each case saved as it ends: a hang names the case)
    release()


def ranks_of(tmp_path_factory, ranks: int) -> list:
    return run_two_ranks(__file__, tmp_path_factory.mktemp("ranks"), TIMEOUT, ranks=ranks,
                         env={CASES_VARIABLE: ",".join(CASES)})


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return ranks_of(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    return ranks_of(tmp_path_factory, 3)


WORDS = {"one_entry_loss": "the loss has shape (1,) for 5 examples", "redraw_fails": "could not run this model",
         "backward_value_error": "could not run this model", "backward_runtime_error": "(RuntimeError;"}


@pytest.mark.parametrize("case", list(CASES))
def test_a_failure_on_one_ranks_share_is_refused_on_every_rank_alike(two_ranks, case):
    single = verdict(case)
    assert single[0] == "refused" and WORDS[case] in single[1], single
    assert all(got[case] == two_ranks[0][case] for got in two_ranks), [got[case] for got in two_ranks]
    assert two_ranks[0][case][0] == "refused" and WORDS[case] in two_ranks[0][case][1], two_ranks[0][case]


@pytest.mark.parametrize("case", list(CASES))
def test_on_three_ranks_too(three_ranks, case):
    assert all(got[case] == three_ranks[0][case] for got in three_ranks), [got[case] for got in three_ranks]
    assert three_ranks[0][case][0] == "refused" and WORDS[case] in three_ranks[0][case][1], three_ranks[0][case]


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
