"""The start-up probe on an FSDP2-sharded model (``dptext.privacy.proof.sharded_probe``): 2 gloo processes.

Every rank runs the probe together on the same synthetic batch and no rank gathers more than one FSDP2 unit at a
time outside the passes. Checked against the one-process probe on the same unsharded model: the same verdict per
layer in book-keeping, ghost and per_sample (a tied embedding and head, a layer of one row that rank 1 owns none
of, a position embedding re-run alone in a unit of its own); the same refusals — a weight read outside its layer
(a functional use, or through its shard with ``full_tensor()`` in the forward or the loss), examples that
interact, a buffer a training forward changes; a finding on rank 1 only stops both ranks (no rank left waiting in
a collective); a clipped sum made wrong on rank 1's rows only is refused on both ranks; an all-zero gate is
re-drawn for the probe (its shard written in place on each rank) and given back; the weights are untouched after
it, no gradient is left and a step after it equals one without it; bf16-stored weights are refused in one
sentence, a bf16 policy is proven with the weights gathered as stored; ranks whose reports differ are refused.
Several cases come from the session-25 red team.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from fsdp_models import N, VOCAB, FunctionalHead, TinyLM, full, losses, shard, token_ids
from test_fsdp_redteam import moves, narrow_lm, outcome
from two_ranks import run_two_ranks

C = 0.5
TIMEOUT = 240
MODES = ("bookkeeping", "ghost", "per_sample")


class Mixing(TinyLM):
    """Each example's hidden state moved by the batch mean: examples interact (a per-example clipping bound no
    longer holds)."""

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        hidden = hidden + hidden.mean(dim=0, keepdim=True)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


class Counting(TinyLM):
    """A buffer the training forward changes (a running statistic computed from the private batch)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(1, dtype=torch.float64))

    def forward(self, input_ids):
        self.seen += input_ids.shape[0]
        return super().forward(input_ids)


class Gated(TinyLM):
    """A gate that starts at zero (LoRA's B, a ReZero gate): below it no layer receives a gradient until it moves."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(6, 6, bias=False)
        nn.init.zeros_(self.gate.weight)

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = hidden + self.gate(block(hidden))
        return self.head(hidden)


def whole(weight):
    """The whole weight: ``full_tensor()`` of a shard (an all-gather outside FSDP2's passes), else itself."""
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight


class CrossRead(TinyLM):
    """Block 0's weight read again after the blocks, through its shard (``full_tensor()``): a path around the
    layer that FSDP2's gathered parameters do not carry (found by the session-25 red team)."""

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden + 0.3 * torch.tanh(hidden @ whole(self.blocks[0].fc.weight)))


class PositionBlock(nn.Module):
    """A block with a learned position embedding called on a batch-1 index (broadcast to the batch), inside an
    FSDP2 unit of its own: the probe re-runs it alone after the pass (BERT's embeddings unit)."""

    def __init__(self, width: int):
        super().__init__()
        self.position = nn.Embedding(16, width)
        self.fc = nn.Linear(width, width)

    def forward(self, hidden):
        return hidden + torch.tanh(self.fc(hidden + self.position(torch.arange(hidden.shape[1])[None])))


class Positions(TinyLM):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([PositionBlock(6), PositionBlock(6)])


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


class MixingOnRank1(TinyLM):
    """Examples interact on rank 1 only: the ranks' probes would part ways (and wait for each other for ever)."""

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        hidden = hidden + hidden.mean(dim=0, keepdim=True) * (rank() == 1)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


class CountingOnRank1(Counting):
    def forward(self, input_ids):
        if rank() == 1:
            self.seen += 1
        return TinyLM.forward(self, input_ids)


BUILDERS = {"tiny": TinyLM, "narrow": None, "functional": FunctionalHead, "mixing": Mixing, "counting": Counting,
            "gated": Gated, "cross_read": CrossRead, "positions": Positions}
ON_RANK_1 = {"mixing_on_rank_1": MixingOnRank1, "counting_on_rank_1": CountingOnRank1}


def build(kind: str) -> nn.Module:
    if kind == "narrow":
        return narrow_lm()
    torch.manual_seed(0)
    return {**BUILDERS, **ON_RANK_1}[kind]().double()


def make_batch(examples, positions, generator):
    return {"input_ids": torch.randint(0, VOCAB, (examples, positions), generator=generator)}


def probe_loss(model, batch):
    return losses(model, batch["input_ids"])


def engine_for(model, mode, ctx=None):
    from dptext.privacy import PrivacyEngine

    return PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0, max_grad_norm=C,
                         expected_batch_size=4, dataset_size=12, clipping_mode=mode, distributed=ctx, verify=False)


def penalty_loss(model, batch):
    """The per-example losses plus a penalty on a block's weight read in the loss (through its shard)."""
    return losses(model, batch["input_ids"]) + 0.05 * whole(model.blocks[0].fc.weight).pow(2).sum()


def verdict(kind: str, mode: str, ctx=None) -> dict:
    """The probe's statuses per layer (or its refusal), the weights' change and what it left behind."""
    model = shard(build(kind.removesuffix("_penalty")), ctx)
    before = {name: full(p).detach().clone() for name, p in model.named_parameters()}
    engine = engine_for(model, mode, ctx)
    loss = penalty_loss if kind.endswith("_penalty") else probe_loss
    got = outcome(lambda: {row["name"]: row["status"] for row in engine.verify(make_batch, loss).table()})
    moved = max(float((full(p).detach() - before[name]).abs().max()) for name, p in model.named_parameters())
    grads = [name for name, p in model.named_parameters() if p.grad is not None]
    sharded_after = all(hasattr(p, "to_local") for p in model.parameters()) if ctx is not None else True
    step = moves(model, engine, token_ids()[ctx.shard(N) if ctx is not None else slice(None)]) \
        if got[0] == "ok" else None  # a noise-free step after the probe: nothing of the probe may be in it
    engine.detach()
    return {"outcome": got, "moved": moved, "grads": grads, "resharded": sharded_after, "step": step}


def skewed_sum(ctx, mode: str) -> tuple:
    """Rank 1's rows of one layer's clipped sum scaled by 1.01 after the reduction (``add_reduced``): rank 0's
    rows are right, so only the all-reduce of the differences can see it."""
    from dptext.privacy.sharding.sharded import ShardedDPOptimizer

    model = shard(build("tiny"), ctx)
    engine = engine_for(model, mode, ctx)
    real = ShardedDPOptimizer.add_reduced

    def skewed(self, rows, units):
        if ctx.rank == 1:
            rows = {p: r * 1.01 if p is engine.params[0] else r for p, r in rows.items()}
        return real(self, rows, units)

    ShardedDPOptimizer.add_reduced = skewed
    try:
        return outcome(lambda: engine.verify(make_batch, probe_loss))
    finally:
        ShardedDPOptimizer.add_reduced = real
        engine.detach()


def half_weights(ctx, stored: bool) -> tuple:
    """bf16 weights gathered by FSDP2's policy (proven gathered as stored), or stored in bf16 (refused)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from dptext.finetune.sharding import shard_model

    model = build("tiny").to(torch.bfloat16 if stored else torch.float64)
    shard_model(model, list(model.blocks), None if stored else MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    return said(lambda: engine_for(model, "bookkeeping", ctx).verify(make_batch, probe_loss))


def disguised_hook(ctx) -> tuple:
    """A foreign forward hook on block 1's layer, bound to FSDP2's own state object so that it looks like FSDP2's
    pass hooks (session-25 red team): it must count as the instance's own code (block 1 compared itself)."""
    import types

    def second_use(self, module, args, output):
        return output + 0.5 * nn.functional.linear(args[0], module.weight)

    model = shard(build("tiny"), ctx)
    model.blocks[1].fc.register_forward_hook(types.MethodType(second_use, model.blocks[1]._get_fsdp_state()))
    return said(lambda: engine_for(model, "bookkeeping", ctx).verify(make_batch, probe_loss))


def said(action) -> tuple:
    """("ok", the statuses) or ("refused", the sentence): nothing that holds the model."""
    verdict_, got = outcome(action)
    return verdict_, sorted({row["status"] for row in got.table()}) if verdict_ == "ok" else got


def changed_reduction(ctx, change: str) -> tuple:
    """Ghost clipping's sums are reduced by FSDP2: a hook on block 1's reduced gradients (×1.5) or a bf16 reduce
    dtype there changes them on that unit only, which the probe's one compared block would not see."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build("tiny")
    for number, block in enumerate(model.blocks):
        bf16 = change == "bf16" and number == 1
        fully_shard(block, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if bf16 else None))
    fully_shard(model)
    if change == "hook":
        model.blocks[1].set_all_reduce_hook(lambda reduced: reduced.mul_(1.5))
    return said(lambda: engine_for(model, "ghost", ctx).verify(make_batch, probe_loss))


def global_random_batch(ctx) -> tuple:
    """A ``make_batch`` that ignores its generator and draws from the global state, seeded apart on each rank."""
    model = shard(build("tiny"), ctx)
    torch.manual_seed(100 + ctx.rank)  # after build(), which seeds alike
    return said(lambda: engine_for(model, "bookkeeping", ctx).verify(
        lambda examples, positions, generator: make_batch(examples, positions, None), probe_loss))


def second_use_hook(module, args, output):
    """A global module hook acting on block 1's layer only: a second use of its weight the rule does not see."""
    return output + 0.5 * nn.functional.linear(args[0], module.weight) if getattr(module, "marked", False) else None


def global_hook(ctx=None) -> tuple:
    """A global module hook (``register_module_forward_hook``) that acts on one layer only must not hide behind
    that layer's pattern-mate (session-25 red team: accepted in one process and sharded, a 1.5x gradient)."""
    model = shard(build("tiny"), ctx)
    model.blocks[1].fc.marked = True
    handle = nn.modules.module.register_module_forward_hook(second_use_hook)
    try:
        return said(lambda: engine_for(model, "bookkeeping", ctx).verify(make_batch, probe_loss))
    finally:
        handle.remove()


def sync_off_on_one_unit(ctx) -> tuple:
    """Ghost with FSDP2's gradient sync off on block 1 only: its sums would never be reduced (and a later step
    would release them all at once)."""
    model = shard(build("tiny"), ctx)
    model.blocks[1].set_requires_gradient_sync(False, recurse=False)
    return said(lambda: engine_for(model, "ghost", ctx).verify(make_batch, probe_loss))


def kept_gathered(ctx, mode: str) -> tuple:
    """Book-keeping and per_sample with a unit kept gathered after the backward (FSDP2's accumulation idiom): its
    sums were dropped silently (session-25 red team); now one sentence."""
    model = shard(build("tiny"), ctx)
    engine = engine_for(model, mode, ctx)
    engine.verify(make_batch, probe_loss)
    model.set_reshard_after_backward(False)
    return said(lambda: moves(model, engine, token_ids()[ctx.shard(N)]))


def ghost_steps(ctx, case: str):
    """Ghost clipping when FSDP2 holds sums back (gradient sync off for a backward; session-25 red team round 4):
    "across": the step after a sync-off micro-batch is refused and drops the batch, so the next step holds only its
    own; "idiom": sync off for the first micro-batch of a step and on for the last (FSDP2's accumulation idiom)
    is exact; "dropped": zero_grad() after a sync-off micro-batch drops what FSDP2 held. Returns the refusal (if
    any) and the final step's moves."""
    model = shard(build("tiny"), ctx)
    engine = engine_for(model, "ghost", ctx)
    engine.verify(make_batch, probe_loss)
    ids = token_ids()[ctx.shard(N)]
    first, second = ids[:3], ids[3:]
    before = {name: full(p).detach().clone() for name, p in model.named_parameters()}
    model.set_requires_gradient_sync(False)
    engine.accumulate(losses(model, first))
    refused = ""
    if case == "across":
        refused = said(engine.step)
        model.set_requires_gradient_sync(True)
    elif case == "dropped":
        engine.zero_grad()
        model.set_requires_gradient_sync(True)
    else:
        model.set_requires_gradient_sync(True)
    engine.accumulate(losses(model, second))
    engine.step()
    return refused, {name: full(p).detach() - before[name] for name, p in model.named_parameters()}


def one_process_ghost_moves(indices) -> dict:
    """-(the clipped sum of ``indices`` on every rank's shard) / B, in one process (what ghost_steps must equal)."""
    model = build("tiny")
    engine = engine_for(model, "ghost")
    per_rank = [token_ids()[list(range(rank, N, 2))] for rank in range(2)]
    ids = torch.cat([each[indices] for each in per_rank])
    return moves(model, engine, ids)


def gradient_hook(ctx=None) -> tuple:
    """A hook rescaling one trained parameter's accumulated gradient: ghost's sums pass through it."""
    model = shard(build("tiny"), ctx)
    model.blocks[1].fc.weight.register_post_accumulate_grad_hook(lambda param: param.grad.mul_(1.5))
    return said(lambda: engine_for(model, "ghost", ctx).verify(make_batch, probe_loss))


def sync_off_after_the_probe(ctx) -> tuple:
    """Ghost, proven, then gradient sync turned off on block 1 only: that unit's sums would never be reduced."""
    model = shard(build("tiny"), ctx)
    engine = engine_for(model, "ghost", ctx)
    engine.verify(make_batch, probe_loss)
    model.blocks[1].set_requires_gradient_sync(False, recurse=False)
    return said(lambda: engine.accumulate(losses(model, token_ids()[ctx.shard(N)])))


def sync_off_probe(ctx) -> tuple:
    model = shard(build("tiny"), ctx)
    model.set_requires_gradient_sync(False)
    return said(lambda: engine_for(model, "ghost", ctx).verify(make_batch, probe_loss))


def disagreement(ctx) -> str | None:
    from dptext.privacy.proof.sharded_probe import agreed

    return agreed([{"name": "fc", "status": "exact" if ctx.rank == 0 else "refused"}])


def worker(out: Path) -> None:
    from dptext.finetune.distributed import current, release

    ctx = current("cpu")
    ctx.sharded = True
    results = {
        "verdicts": {(kind, mode): verdict(kind, mode, ctx) for kind in [*BUILDERS, "tiny_penalty"]
                     for mode in MODES},
        "on_rank_1": {kind: verdict(kind, "bookkeeping", ctx)["outcome"] for kind in ON_RANK_1},
        "skewed": {mode: skewed_sum(ctx, mode) for mode in ("bookkeeping", "per_sample", "ghost")},
        "half": {stored: half_weights(ctx, stored) for stored in (False, True)},
        "disagree": disagreement(ctx),
        "disguised": disguised_hook(ctx),
        "reduction": {change: changed_reduction(ctx, change) for change in ("hook", "bf16")},
        "global_random": global_random_batch(ctx),
        "global_hook": global_hook(ctx),
        "sync_off": sync_off_on_one_unit(ctx),
        "kept_gathered": {mode: kept_gathered(ctx, mode) for mode in ("bookkeeping", "per_sample")},
        "held": {case: ghost_steps(ctx, case) for case in ("across", "idiom", "dropped")},
        "gradient_hook": gradient_hook(ctx),
        "sync_off_probe": sync_off_probe(ctx),
        "sync_off_after": sync_off_after_the_probe(ctx),
    }
    torch.save(results, out / f"rank{ctx.rank}.pt")
    release()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_two_ranks(__file__, tmp_path_factory.mktemp("ranks"), TIMEOUT)


@pytest.mark.parametrize("kind", [*BUILDERS, "tiny_penalty"])
@pytest.mark.parametrize("mode", MODES)
def test_the_sharded_probe_reaches_the_one_process_verdict(two_ranks, kind, mode):
    single = verdict(kind, mode)
    for rank in two_ranks:
        got = rank["verdicts"][(kind, mode)]
        assert got["outcome"][0] == single["outcome"][0], (got["outcome"], single["outcome"])
        if single["outcome"][0] == "ok":
            assert got["outcome"][1] == single["outcome"][1]
        assert got["moved"] == 0.0 and got["grads"] == [] and got["resharded"], got
        if single["step"] is not None:
            for name, move in single["step"].items():
                torch.testing.assert_close(got["step"][name], move, rtol=1e-5, atol=1e-7)


def test_the_one_process_verdicts_are_what_the_models_are_built_for():
    # the cases above compare with the one-process probe: pin what it says, so the comparison cannot pass vacuously
    assert set(verdict("tiny", "bookkeeping")["outcome"][1].values()) == {"exact"}
    assert set(verdict("gated", "bookkeeping")["outcome"][1].values()) == {"exact"}  # the gate re-drawn
    assert set(verdict("positions", "bookkeeping")["outcome"][1].values()) == {"exact"}
    for kind, words in (("functional", "read outside"), ("mixing", "example"), ("counting", "seen"),
                        ("cross_read", "read outside"), ("tiny_penalty", "read outside")):
        got = verdict(kind, "bookkeeping")["outcome"]
        assert got[0] == "refused" and words in got[1], got


@pytest.mark.parametrize("kind", list(ON_RANK_1))
def test_a_finding_on_one_rank_only_stops_every_rank(two_ranks, kind):
    # each pass is a collective: a rank that stopped while the other went on would leave it waiting for ever
    for rank in two_ranks:
        verdict_, message = rank["on_rank_1"][kind]
        assert verdict_ == "refused", message


@pytest.mark.parametrize("mode", ["bookkeeping", "per_sample", "ghost"])
def test_a_clipped_sum_wrong_on_one_ranks_rows_only_is_refused_on_every_rank(two_ranks, mode):
    for rank in two_ranks:
        verdict_, message = rank["skewed"][mode]
        assert verdict_ == "refused" and "clipped sums differ" in message, message


def test_bf16_stored_weights_are_refused_in_one_sentence_and_a_bf16_policy_is_proven_gathered_as_stored(two_ranks):
    # the policy's case in detail (gathered dtypes, the steps after it): tests/test_fsdp_precision.py
    for rank in two_ranks:
        verdict_, message = rank["half"][True]
        assert verdict_ == "refused" and "stored in torch.bfloat16" in message, message
        assert rank["half"][False] == ("ok", ["exact"]), rank["half"][False]


REFUSALS = {  # the worker's case -> words of its one sentence, on every rank
    "disguised": "blocks.1.fc",  # a foreign hook bound to FSDP2's state is still foreign code
    "global_random": "differs between the ranks",  # batches drawn from the global state, seeded apart per rank
    "global_hook": "blocks.1.fc",  # a global module hook on one layer does not hide behind its pattern-mate
    "sync_off": "sync is off",  # ghost, sync off on one unit: the probe's own check (any unit)
    "sync_off_probe": "Gradient sync is off",  # ghost, sync off everywhere during the probe
    "sync_off_after": "gradient sync off on this unit only",  # ghost, one unit's sync turned off after the probe
    "gradient_hook": "gradient hook",  # ghost, a hook rescaling one trained parameter's gradient
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_the_sharded_probe_and_step_refuse_in_one_sentence_on_every_rank(two_ranks, case):
    for rank in two_ranks:
        verdict_, message = rank[case]
        assert verdict_ == "refused" and REFUSALS[case] in message, message


@pytest.mark.parametrize("check, words", [(global_hook, "blocks.1.fc"), (gradient_hook, "gradient hook")],
                         ids=["global_hook", "gradient_hook"])
def test_one_process_refuses_a_global_hook_and_a_gradient_hook_alike(check, words):
    verdict_, message = check()
    assert verdict_ == "refused" and words in message, message


@pytest.mark.parametrize("change, words", [("hook", "set_all_reduce_hook"), ("bf16", "reduce dtype")])
def test_ghost_refuses_a_reduction_fsdp2_changes_on_one_unit(two_ranks, change, words):
    for rank in two_ranks:
        verdict_, message = rank["reduction"][change]
        assert verdict_ == "refused" and words in message, message


@pytest.mark.parametrize("mode", ["bookkeeping", "per_sample"])
def test_a_unit_kept_gathered_after_the_backward_is_refused_in_one_sentence(two_ranks, mode):
    for rank in two_ranks:
        verdict_, message = rank["kept_gathered"][mode]
        assert verdict_ == "refused" and "set_reshard_after_backward" in message, message


def test_ghost_never_lets_fsdp2_carry_clipped_sums_into_another_step(two_ranks):
    for rank in two_ranks:
        refused, got = rank["held"]["across"]
        assert refused[0] == "refused" and "still holds clipped sums" in refused[1], refused
        for name, move in one_process_ghost_moves(slice(3, None)).items():  # the second step: its own batch only
            torch.testing.assert_close(got[name], move, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("case, rows", [("idiom", slice(None)), ("dropped", slice(3, None))])
def test_ghost_with_fsdp2s_accumulation_idiom_or_a_dropped_batch_is_exact(two_ranks, case, rows):
    for rank in two_ranks:
        refused, got = rank["held"][case]
        assert refused == ""
        for name, move in one_process_ghost_moves(rows).items():
            torch.testing.assert_close(got[name], move, rtol=1e-5, atol=1e-7)


def test_a_block_tied_to_a_module_outside_it_is_left_to_the_root_unit():
    # BERT's word embeddings (their own FSDP2 unit) are tied to the masked-LM decoder (the root's): FSDP2 cannot
    # hold one parameter in two units, so finetune leaves that block to the root (session-25 red team)
    from dptext.finetune.sharding import transformer_blocks

    model = build("tiny")
    assert transformer_blocks(model) == list(model.blocks)
    model.extra = nn.Linear(6, 6)
    model.extra.weight = model.blocks[1].fc.weight
    assert transformer_blocks(model) == [model.blocks[0]]
    repeated = build("tiny")
    repeated.blocks = nn.ModuleList([repeated.blocks[0], repeated.blocks[0]])  # one instance listed twice
    assert transformer_blocks(repeated) == [repeated.blocks[0]]


def test_ranks_whose_reports_differ_say_so(two_ranks):
    assert [rank["disagree"] for rank in two_ranks] == ["rank 0 and rank 1", "rank 1 and rank 0"]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    worker(Path(sys.argv[1]))
