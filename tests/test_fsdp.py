"""FSDP2-sharded DP training: 2 gloo processes on CPU against the single-process engine (docs/sharding.md).

The engine-level checks run once in two worker processes (this file run as a script with torchrun's environment)
on a tiny fp64 transformer-like model with a tied embedding, sharded with ``fully_shard`` per block and at the
root, and are compared here with single-process twins: (a) the update of one noise-free step (SGD, lr 1: the
clipped sum / B) equals the single-process one for book-keeping, ghost, per_sample and per-layer clipping; (b) a
noise-only step gives every coordinate exactly the noise of one process with the same key — each coordinate drawn
once, by the rank that owns it — with std σ·C; (c) per-rank parameter + gradient + Adam-state bytes are about
half of the unsharded ones; (d) a rank with no examples joins with empty passes and changes nothing (book-keeping
and ghost); (e) the non-private gradient is the mean over every rank's examples; (f) ghost clipping reduce-scatters
once per FSDP2 group per micro-batch (its norm-only pass none) and leaves no gradient behind, its per-step bound
is checked over every rank's rows, and a parameter read outside its layer is still refused under sharding.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from fsdp_models import N, VOCAB, FunctionalHead, full, losses, refusal, shard, tiny_lm, token_ids
from two_ranks import FAILURES, fails_on_rank_1, run_two_ranks

C = 0.5
CASES = (("bookkeeping", "all_layer"), ("ghost", "all_layer"), ("per_sample", "all_layer"),
         ("bookkeeping", "per_layer"))
GROUPS = 3  # FSDP2 groups of ``shard``: two blocks and the root
SIGMA, NOISE_C, NOISE_SEED = 1.3, 0.7, 5
TIMEOUT = 240


def dp_update(mode: str, layout: str, ctx=None, indices=None):
    """-(the clipped sum of ``indices`` on every rank) / B: one noise-free SGD step with lr 1, gathered."""
    from dptext.privacy import PrivacyEngine

    model = shard(tiny_lm(), ctx)
    before = {name: full(p).detach().clone() for name, p in model.named_parameters()}
    engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                           max_grad_norm=C, expected_batch_size=N, dataset_size=N, clipping_mode=mode,
                           clipping_layout=layout, distributed=ctx, verify=False)
    ids = token_ids()
    engine.accumulate(losses(model, ids[list(range(N)) if indices is None else indices]))
    engine.step()
    return {name: full(p).detach() - before[name] for name, p in model.named_parameters()}


class TokenTask:
    """The two task methods the loop's empty pass uses, for ``token_ids`` batches."""

    def probe_batch(self, model, generator, batch_size, seq_len):
        return {"input_ids": torch.randint(0, VOCAB, (batch_size, seq_len), generator=generator)}

    def per_example_loss(self, model, batch):
        return losses(model, batch["input_ids"])


def uneven_update(ctx, mode: str):
    """Rank 0 holds every example (3 micro-batches), rank 1 none: it joins the collectives with empty passes."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from dptext.finetune.sharding import empty_pass, same_count_on_every_rank
    from dptext.privacy import PrivacyEngine

    model = shard(tiny_lm(), ctx)
    before = {name: full(p).detach().clone() for name, p in model.named_parameters()}
    engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                           max_grad_norm=C, expected_batch_size=N, dataset_size=N, clipping_mode=mode, distributed=ctx,
                           verify=False)
    ids = token_ids()
    training = SimpleNamespace(dist=ctx, engine=engine, model=model, task=TokenTask(), device=torch.device("cpu"))
    mine = list(range(N)) if ctx.rank == 0 else []
    chunks = same_count_on_every_rank(training, [mine[i:i + 4] for i in range(0, len(mine), 4)])
    for chunk in chunks:
        if chunk:
            engine.accumulate(losses(model, ids[chunk]))
        else:
            empty_pass(training, nullcontext())
    engine.step()
    return len(chunks), {name: full(p).detach() - before[name] for name, p in model.named_parameters()}


def noise_step(ctx=None, mode: str = "bookkeeping"):
    """The parameter moves of one noise-only step (SGD, lr 1) of a model with 2 × 300 × 301 + 2 coordinates."""
    from dptext.privacy import PrivacyEngine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(301, 300), nn.Linear(300, 301))
    shard(model, ctx, blocks=list(model))
    before = {name: full(p).detach().clone() for name, p in model.named_parameters()}
    engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=SIGMA,
                           max_grad_norm=NOISE_C, expected_batch_size=10, dataset_size=100, seed=NOISE_SEED,
                           clipping_mode=mode, distributed=ctx, verify=False)
    engine.step()
    return {name: full(p).detach() - before[name] for name, p in model.named_parameters()}


def adam_bytes(ctx=None) -> int:
    from dptext.finetune.sharding import held_bytes
    from dptext.privacy import PrivacyEngine

    model = shard(tiny_lm(), ctx)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine = PrivacyEngine(model, optimizer, noise_multiplier=1.0, max_grad_norm=C, expected_batch_size=N,
                           dataset_size=N, distributed=ctx, verify=False)
    engine.accumulate(losses(model, token_ids()[:2]))
    engine.step()
    return held_bytes(model, optimizer)


def ghost_collectives(ctx) -> dict:
    """One ghost micro-batch: the reduce-scatters FSDP2 ran (pass 2 only: one per group), the gradients left on the
    parameters (none), and the step's refusal when the bound over every rank's rows fails (C shrunk after clipping)."""
    import torch.distributed as dist

    from dptext.errors import UserError
    from dptext.privacy import PrivacyEngine

    model = shard(tiny_lm(), ctx)
    engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                           max_grad_norm=C, expected_batch_size=N, dataset_size=N, clipping_mode="ghost",
                           distributed=ctx, verify=False)
    calls, scatter = [], dist.reduce_scatter_single
    dist.reduce_scatter_single = lambda *args, **kwargs: calls.append(1) or scatter(*args, **kwargs)
    try:
        engine.accumulate(losses(model, token_ids()[ctx.shard(N)]))
    finally:
        dist.reduce_scatter_single = scatter
    left = [name for name, param in model.named_parameters() if param.grad is not None]
    engine.dp_optimizer.max_grad_norm = C / 100
    try:
        engine.step()
        refusal = ""
    except UserError as error:
        refusal = str(error)
    engine.detach()  # training on without DP: FSDP2 must average again, as on a model no engine touched
    plain = shard(tiny_lm(), ctx)
    for each in (model, plain):
        each.zero_grad()
        losses(each, token_ids()[ctx.shard(N)]).sum().backward()
    detached = {name: (full(p.grad), full(dict(plain.named_parameters())[name].grad))
                for name, p in model.named_parameters()}
    return {"scatters": len(calls), "left": left, "refusal": refusal, "detached": detached}


def ghost_reduction_guarded(ctx) -> dict:
    """One ghost engine per FSDP2 model (a second one is refused before it attaches anything; allowed again after
    detach), and a reduction changed by hand after the engine set the plain sum stops the next micro-batch on every
    rank, a rank with an empty micro-batch included."""
    from dptext.privacy import PrivacyEngine
    from dptext.privacy.clipping.clipped_step import ghost_join
    from dptext.privacy.sharding.fsdp_controls import fsdp_modules

    model = shard(tiny_lm(), ctx)

    def ghost_engine():
        return PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                             max_grad_norm=C, expected_batch_size=N, dataset_size=N, clipping_mode="ghost",
                             distributed=ctx, verify=False)

    def hooks() -> int:
        return sum(len(module._forward_hooks) for module in model.modules())

    first = ghost_engine()
    before = hooks()
    second = refusal(ghost_engine)
    hooks_unchanged = hooks() == before
    first.detach()
    engines = []
    after_detach = refusal(lambda: engines.append(ghost_engine()))
    for module in fsdp_modules(model):
        module.set_gradient_divide_factor(float(ctx.world_size))  # the mean again, by hand
    if ctx.rank == 0:
        changed = refusal(lambda: engines[0].accumulate(losses(model, token_ids()[ctx.shard(N)])))
    else:  # an empty micro-batch on this rank (ghost_join) must refuse too, not wait in the second pass
        changed = refusal(lambda: ghost_join(engines[0], losses(model, token_ids()[:2])))
    return {"second": second, "hooks_unchanged": hooks_unchanged, "changed": changed, "after_detach": after_detach}


def sync_settings_kept(ctx) -> list:
    """A caller's own FSDP2 sync setting (all-reduce off, as HSDP's gradient accumulation sets it) survives a ghost
    micro-batch, whose norm pass turns gradient sync off and then back to what it was, not simply on."""
    from dptext.privacy import PrivacyEngine
    from dptext.privacy.sharding.fsdp_controls import fsdp_modules

    model = shard(tiny_lm(), ctx)
    for module in fsdp_modules(model):
        module.set_requires_all_reduce(False, recurse=False)
    engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                           max_grad_norm=C, expected_batch_size=N, dataset_size=N, clipping_mode="ghost",
                           distributed=ctx, verify=False)
    engine.accumulate(losses(model, token_ids()[ctx.shard(N)]))
    engine.zero_grad()
    return [(group.reduce_grads, group.all_reduce_grads) for module in fsdp_modules(model)
            for group in module._get_fsdp_state()._fsdp_param_groups]


def refused_on_one_rank(ctx, mode: str, failure: str) -> dict:
    """Rank 1's check fails (forced) on its micro-batch: both ranks refuse at the step, nothing applied (ghost: the
    refusing rank still joins the second pass's reduce-scatter, or the other rank would wait in it for ever)."""
    from dptext.errors import UserError
    from dptext.privacy import PrivacyEngine

    model = shard(tiny_lm(), ctx)
    engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                           max_grad_norm=C, expected_batch_size=N, dataset_size=N, clipping_mode=mode,
                           distributed=ctx, verify=False)
    before = {name: full(p).detach().clone() for name, p in model.named_parameters()}
    with fails_on_rank_1(failure, ctx.rank, model):
        engine.accumulate(losses(model, token_ids()[ctx.shard(N)]))
    try:
        engine.step()
        refusal = ""
    except UserError as error:
        refusal = str(error)
    unchanged = all(torch.equal(full(p), before[name]) for name, p in model.named_parameters())
    return {"refusal": refusal, "unchanged": unchanged}


def outside_read_refusal(ctx) -> str:
    from dptext.errors import UserError
    from dptext.privacy import PrivacyEngine

    torch.manual_seed(0)
    model = shard(FunctionalHead().double(), ctx)
    engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                           max_grad_norm=C, expected_batch_size=N, dataset_size=N, clipping_mode="ghost",
                           distributed=ctx, verify=False)
    try:  # several processes: found in the micro-batch, refused at the step on every rank (nothing applied)
        engine.accumulate(losses(model, token_ids()[ctx.shard(N)]))
        engine.step()
    except UserError as error:
        return str(error)
    return ""


def held_rows(ctx, mine):
    """Book-keeping and per_sample with one whole layer per chunk (the chunk size forced to 1 coordinate): the
    update (against the single process) and, after one micro-batch, what the optimizer holds — only this rank's
    rows — and how many chunks were reduce-scattered, each of whole layers."""
    from dptext.privacy import PrivacyEngine
    from dptext.privacy.sharding import row_reduce

    real_size, real_reduce = row_reduce.CHUNK_COORDINATES, row_reduce.reduce_rows
    sent = []

    def counting(params, totals, rank, world_size, *cut):
        sent.append([id(param) for param in params])
        return real_reduce(params, totals, rank, world_size, *cut)

    row_reduce.CHUNK_COORDINATES, row_reduce.reduce_rows = 1, counting
    out = {}
    try:
        for mode in ("bookkeeping", "per_sample"):
            out[("update", mode)] = dp_update(mode, "all_layer", ctx, mine)
            model = shard(tiny_lm(), ctx)
            engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                                   max_grad_norm=C, expected_batch_size=N, dataset_size=N, clipping_mode=mode,
                                   distributed=ctx, verify=False)
            sent.clear()
            engine.accumulate(losses(model, token_ids()[mine]))
            optimizer = engine.dp_optimizer
            names = engine.param_names()
            out[("held", mode)] = {
                "summed": len(optimizer.summed),
                "rows_are_local": all(tuple(rows.shape) == tuple(param.to_local().shape)
                                      for param, rows in optimizer.reduced.items()),
                "chunks": [sorted(names[p] for p in chunk) for chunk in optimizer.chunks],
                "sent": len(sent),
            }
    finally:
        row_reduce.CHUNK_COORDINATES, row_reduce.reduce_rows = real_size, real_reduce
    return out


def non_private_mean(ctx, mine):
    """The non-private baseline's gradient: FSDP2's reduce-scatter, then ``average_gradients`` (gathered)."""
    model = shard(tiny_lm(), ctx)
    losses(model, token_ids()[mine]).sum().backward()
    ctx.average_gradients(list(model.parameters()), len(mine))
    return {name: full(p.grad) for name, p in model.named_parameters()}


def worker(out: Path) -> None:
    """One rank of the 2-process checks (this file run as a script with torchrun's environment)."""
    from dptext.finetune.distributed import current, release

    ctx = current("cpu")
    ctx.sharded = True
    mine = ctx.shard(N)
    results = {
        "updates": {case: dp_update(*case, ctx, mine) for case in CASES},
        "noise": {mode: noise_step(ctx, mode) for mode in ("bookkeeping", "ghost")},
        "bytes": adam_bytes(ctx),
        "ghost": ghost_collectives(ctx),
        "outside_read": outside_read_refusal(ctx),
        "refused": {(mode, failure): refused_on_one_rank(ctx, mode, failure)
                    for mode in ("bookkeeping", "ghost") for failure in FAILURES},
        "sync_kept": sync_settings_kept(ctx),
        "guarded": ghost_reduction_guarded(ctx),
        "non_private": non_private_mean(ctx, mine),
        "uneven": {mode: uneven_update(ctx, mode) for mode in ("bookkeeping", "ghost", "per_sample")},
        "held_rows": held_rows(ctx, mine),
    }
    torch.save(results, out / f"rank{ctx.rank}.pt")
    release()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_two_ranks(__file__, tmp_path_factory.mktemp("ranks"), TIMEOUT)


@pytest.mark.parametrize("case", CASES, ids=["-".join(case) for case in CASES])
def test_sharded_clipped_sum_equals_single_process(two_ranks, case):
    single = dp_update(*case)
    unclipped = tiny_lm()
    (losses(unclipped, token_ids()).sum() / N).backward()
    raw = {name: -p.grad for name, p in unclipped.named_parameters()}
    assert any(not torch.allclose(single[k], raw[k], atol=1e-4) for k in raw), "clipping never active"
    for rank in two_ranks:
        got = rank["updates"][case]
        assert sorted(got) == sorted(single)
        for name in single:
            assert torch.allclose(got[name], single[name], atol=1e-6, rtol=1e-5), \
                f"{case} {name}: off by {(got[name] - single[name]).abs().max():.3g}"


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
def test_a_rank_without_examples_joins_with_empty_passes_and_adds_nothing(two_ranks, mode):
    single = dp_update(mode, "all_layer")
    for rank in two_ranks:
        count, got = rank["uneven"][mode]
        assert count == 3  # rank 1 ran 3 empty passes (a missing one would hang FSDP2's collectives)
        for name in single:
            assert torch.allclose(got[name], single[name], atol=1e-6, rtol=1e-5), name


@pytest.mark.parametrize("mode", ["bookkeeping", "per_sample"])
def test_a_rank_holds_only_its_rows_of_the_clipped_sums_reduced_a_layer_chunk_at_a_time(two_ranks, mode):
    single = dp_update(mode, "all_layer")
    for rank in two_ranks:
        got = rank["held_rows"][("update", mode)]
        for name in single:
            assert torch.allclose(got[name], single[name], atol=1e-6, rtol=1e-5), name
        held = rank["held_rows"][("held", mode)]
        assert held["summed"] == 0 and held["rows_are_local"]  # no full-size sum kept after the micro-batch
        chunks = held["chunks"]
        assert len(chunks) > 3 and held["sent"] == len(chunks)  # one reduce-scatter per chunk, every chunk
        tied = [chunk for chunk in chunks if any(name.startswith(("embed.", "head.")) for name in chunk)]
        assert len(tied) == 1, chunks  # the tied embedding and head: one parameter, one chunk


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost"])  # ghost's sums arrive reduce-scattered: the same noise
def test_each_coordinate_is_noised_once_with_std_sigma_c(two_ranks, mode):
    from dptext.privacy.noise.randomness import RandomRoot
    from dptext.privacy.sharding.sharded import ShardedNoise

    noise = ShardedNoise(RandomRoot(NOISE_SEED))  # what one process with the same key draws, coordinate by coordinate
    noise.reseed_if_secure()
    for rank in two_ranks:
        for name, move in rank["noise"][mode].items():
            expected = -noise.normal(SIGMA * NOISE_C, name, move.numel(), 0, move.numel(), torch.device("cpu")) / 10
            # every coordinate: once (twice would double it, never would leave 0), and the same draw whoever owns it
            off = (move.flatten() - expected).abs()
            assert off.max() < 1e-6, f"{name}: {int((off > 1e-6).sum())} coordinates off, first {int(off.argmax())}"
    weight = two_ranks[0]["noise"][mode]["0.weight"] * 10  # the noise of the summed gradient, 90k coordinates
    assert weight.std().item() == pytest.approx(SIGMA * NOISE_C, rel=0.02)  # std error ≈ 0.24%: 8 of them
    assert abs(weight.mean().item()) < 0.02


def test_noise_blocks_do_not_repeat_across_parameters_steps_or_blocks():
    from dptext.privacy.noise.randomness import RandomRoot
    from dptext.privacy.sharding.sharded import BLOCK, ShardedNoise

    noise = ShardedNoise(RandomRoot(1))
    noise.reseed_if_secure()
    cpu = torch.device("cpu")
    draws = [noise.normal(1.0, "a", 2 * BLOCK, 0, 2 * BLOCK, cpu), noise.normal(1.0, "b", BLOCK, 0, BLOCK, cpu)]
    noise.step += 1
    draws.append(noise.normal(1.0, "a", 2 * BLOCK, 0, 2 * BLOCK, cpu))
    pieces = [draws[0][:BLOCK], draws[0][BLOCK:], draws[1], draws[2][:BLOCK]]
    for i in range(len(pieces)):
        for j in range(i + 1, len(pieces)):
            assert abs(torch.corrcoef(torch.stack([pieces[i], pieces[j]]))[0, 1]) < 0.02, (i, j)
    # any range (inside a block, across a block boundary, at the end) is the same draw as the whole parameter's
    for start, count in ((100, 50), (BLOCK - 7, 20), (2 * BLOCK - 9, 9)):
        assert torch.equal(noise.normal(1.0, "a", 2 * BLOCK, start, count, cpu), draws[2][start:start + count])


def test_sharded_parameter_gradient_and_adam_bytes_are_about_half(two_ranks):
    unsharded = adam_bytes()
    for rank in two_ranks:
        assert rank["bytes"] <= 0.6 * unsharded, (rank["bytes"], unsharded)


def test_non_private_sharded_gradient_is_the_mean_over_every_rank(two_ranks):
    model = tiny_lm()
    (losses(model, token_ids()).sum() / N).backward()
    for rank in two_ranks:
        for name, param in model.named_parameters():
            assert torch.allclose(rank["non_private"][name], param.grad, atol=1e-10), name


def test_ghost_reduce_scatters_once_per_group_and_leaves_no_gradient(two_ranks):
    for rank in two_ranks:
        assert rank["ghost"]["scatters"] == GROUPS  # the norm-only pass reduce-scattered nothing
        assert rank["ghost"]["left"] == []


def test_a_detached_ghost_engine_gives_fsdp2_its_mean_reduction_back(two_ranks):
    for rank in two_ranks:
        for name, (detached, plain) in rank["ghost"]["detached"].items():
            assert torch.equal(detached, plain), name


def test_ghost_bound_is_checked_over_every_ranks_rows(two_ranks):
    for rank in two_ranks:  # every rank refuses the same step (a single one would leave the others waiting)
        assert "per-step privacy check failed" in rank["ghost"]["refusal"]
        assert "units × C" in rank["ghost"]["refusal"]


def test_ghost_puts_a_callers_sync_settings_back_after_its_norm_pass(two_ranks):
    for rank in two_ranks:
        assert rank["sync_kept"] and all(setting == (True, False) for setting in rank["sync_kept"])


def test_one_ghost_engine_per_fsdp2_model_and_its_summed_reduction_is_checked_at_every_micro_batch(two_ranks):
    for rank in two_ranks:
        guarded = rank["guarded"]
        assert "already has a ghost-clipping privacy engine" in guarded["second"] and guarded["hooks_unchanged"]
        assert "gradient reduction on this model was changed" in guarded["changed"]
        assert guarded["after_detach"] == ""


@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("mode", ("bookkeeping", "ghost"))
def test_a_check_failed_on_one_rank_stops_every_sharded_rank_at_the_step(two_ranks, mode, failure):
    mine, other = two_ranks[1]["refused"][mode, failure], two_ranks[0]["refused"][mode, failure]
    assert FAILURES[failure] in mine["refusal"]
    assert other["refusal"].startswith("Another process's per-step privacy check failed")
    assert mine["unchanged"] and other["unchanged"]


def test_ghost_refuses_a_parameter_read_outside_its_layer_under_sharding(two_ranks):
    for rank in two_ranks:  # FSDP2 hands the layers gathered copies of the weights: the check must follow them
        assert re.search(r"Parameter '(embed|head)\.weight' is read outside the layers", rank["outside_read"])


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
