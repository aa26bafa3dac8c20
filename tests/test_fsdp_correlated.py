"""Banded MF and BLT noise under FSDP2: 2 gloo processes on CPU against one process (docs/sharding.md,
docs/correlated_noise.md).

Run once as two worker processes (this file as a script with torchrun's environment), checked here: (a) the noise of
3 noise-only steps is, coordinate for coordinate, C⁻¹Z of the keyed per-coordinate draws Z that one process with
the same key makes (C⁻¹ solved here as a dense triangular system, not by the filter's recursion); (b) each rank
keeps the filter state of its own rows only, about half of it; (c) every rank trains its members of the same
global cyclic bins (one draw, rank 0's, even with a secret root on every rank), their union is one process's bin
of step t mod P; (d) a run stopped after 2 of 4 steps, its filter state saved in the sharded checkpoint, resumes
on a fresh engine (a fresh secret root) to the straight run's weights bit for bit; (e) torchrun without sharding is
still refused.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn
from fsdp_models import N, full, losses, shard, tiny_lm, token_ids
from two_ranks import run_two_ranks

from dptext.accounting.banded_mf import toeplitz_strategy
from dptext.accounting.blt import BLT, blt_coefficients

BANDS = [1.0, 0.6, 0.3]
STRATEGY = BLT(1.0, (0.5, 0.2), (0.9, 0.6))
SIGMA, C, SEED, SIZE, BINS, STEPS = 1.3, 0.7, 5, 100, 10, 3
MECHANISMS = ("banded_mf", "blt")
TIMEOUT = 240


def engine_for(mechanism: str, model, optimizer, ctx, **options):
    from dptext.privacy.mechanisms.blt import BLTEngine
    from dptext.privacy.mechanisms.banded_mf import BandedMFEngine

    options = {"noise_multiplier": SIGMA, "max_grad_norm": C, "dataset_size": SIZE, "steps": STEPS, "bins": BINS,
               "distributed": ctx, "verify": False, **options}
    if mechanism == "blt":
        return BLTEngine(model, optimizer, blt=STRATEGY, **options)
    return BandedMFEngine(model, optimizer, coefficients=BANDS, **options)


def noise_steps(ctx, mechanism: str):
    """The parameter moves of 3 noise-only steps (SGD, lr 1), and this rank's filter-state size against the full."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(301, 300), nn.Linear(300, 301))
    shard(model, ctx, blocks=list(model))
    engine = engine_for(mechanism, model, torch.optim.SGD(model.parameters(), lr=1.0), ctx, seed=SEED)
    moves = []
    for _ in range(STEPS):
        before = {name: full(p).detach().clone() for name, p in model.named_parameters()}
        engine.step()
        moves.append({name: full(p).detach() - before[name] for name, p in model.named_parameters()})
    noise = engine.dp_optimizer.noise
    kept = sum(t.numel() for i in range(len(noise.params)) for t in noise.kept(i))
    whole = sum(p.numel() * len(noise.kept(i)) for i, p in enumerate(noise.params))
    return moves, (kept, whole)


def batches(ctx, seed):
    model = shard(tiny_lm(), ctx)
    engine = engine_for("blt", model, torch.optim.SGD(model.parameters(), lr=1.0), ctx, dataset_size=N, bins=4,
                        steps=8, seed=seed)
    sampler = engine.sampler(8)
    return [list(batch) for batch in sampler], sampler.bin_of.tolist()


def resumed_weights(ctx, mechanism: str, out: Path):
    """4 steps straight, saved after step 2 (sharded weights + filter state, rank 0's engine state); then a fresh
    model and engine with a fresh secret root read that checkpoint and take steps 3 and 4."""
    from dptext.finetune.sharded_checkpoint import load_weights, save_weights

    def build():
        model = shard(tiny_lm(), ctx)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        engine = engine_for(mechanism, model, optimizer, ctx, dataset_size=N, bins=4, steps=4)  # secret root
        return SimpleNamespace(dist=ctx, model=model, optimizer=optimizer, engine=engine)

    ids, mine = token_ids(), ctx.shard(N)
    straight, folder = build(), out / f"checkpoints-{mechanism}"
    for step in range(4):
        straight.engine.step(losses(straight.model, ids[mine[step::4]]))
        if step == 1:
            name = save_weights(straight, folder, 2)
            state = ctx.broadcast(straight.engine.state_dict())  # what step-N.pt holds: rank 0's
    again = build()
    load_weights(again, folder, name)
    again.engine.load_state_dict(state)
    for step in range(2, 4):
        again.engine.step(losses(again.model, ids[mine[step::4]]))
    return {run: {name: full(p).detach() for name, p in training.model.named_parameters()}
            for run, training in (("straight", straight), ("resumed", again))}


def worker(out: Path) -> None:
    from dptext.finetune.distributed import current, release

    ctx = current("cpu")
    ctx.sharded = True
    results = {
        "noise": {mechanism: noise_steps(ctx, mechanism) for mechanism in MECHANISMS},
        "bins": {"seeded": batches(ctx, SEED), "secret": batches(ctx, None)},
        "resume": {mechanism: resumed_weights(ctx, mechanism, out) for mechanism in MECHANISMS},
    }
    torch.save(results, out / f"rank{ctx.rank}.pt")
    release()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_two_ranks(__file__, tmp_path_factory.mktemp("ranks"), TIMEOUT)


def strategy_matrix(mechanism: str) -> np.ndarray:
    if mechanism == "banded_mf":
        return toeplitz_strategy(BANDS, STEPS)
    coeffs = blt_coefficients(STRATEGY, STEPS)
    return np.array([[coeffs[i - j] if i >= j else 0.0 for j in range(STEPS)] for i in range(STEPS)])


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_sharded_correlated_noise_is_the_one_process_noise_coordinate_for_coordinate(two_ranks, mechanism):
    from dptext.privacy.noise.randomness import RandomRoot
    from dptext.privacy.sharding.sharded import ShardedNoise

    noise = ShardedNoise(RandomRoot(SEED))  # one process with the same key: Z, then w = C⁻¹Z per coordinate
    noise.reseed_if_secure()
    moves = two_ranks[0]["noise"][mechanism][0]
    draws = {}
    for name, move in moves[0].items():
        z = []
        for step in range(STEPS):
            noise.step = step
            z.append(noise.normal(SIGMA * C, name, move.numel(), 0, move.numel(), torch.device("cpu")).double())
        draws[name] = np.linalg.solve(strategy_matrix(mechanism), torch.stack(z).numpy())  # (steps, coordinates)
    for rank in two_ranks:
        for step, moved in enumerate(rank["noise"][mechanism][0]):
            for name, move in moved.items():
                expected = torch.from_numpy(-draws[name][step] / (SIZE / BINS)).float()
                off = (move.flatten() - expected).abs()
                assert off.max() < 1e-5, f"{mechanism} step {step} {name}: {int((off > 1e-5).sum())} off"
    assert not torch.allclose(moves[1]["0.weight"], moves[0]["0.weight"])  # correlated, not repeated


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_each_rank_keeps_the_filter_state_of_its_own_rows_only(two_ranks, mechanism):
    for rank in two_ranks:
        kept, whole = rank["noise"][mechanism][1]
        assert whole > 0 and 0.45 * whole <= kept <= 0.55 * whole, (kept, whole)


def test_every_rank_trains_its_members_of_the_same_global_cyclic_bins(two_ranks):
    from dptext.privacy.noise.randomness import RandomRoot
    from dptext.privacy.sampling.cyclic import CyclicBinSampler

    one = [list(batch) for batch in CyclicBinSampler(N, 4, 8, RandomRoot(SEED).generator("sampler"))]
    union = [sorted(a + b) for a, b in zip(*(rank["bins"]["seeded"][0] for rank in two_ranks))]
    assert union == [sorted(batch) for batch in one]
    for kind in ("seeded", "secret"):
        assert two_ranks[0]["bins"][kind][1] == two_ranks[1]["bins"][kind][1]  # one global draw of the bins
        for r, rank in enumerate(two_ranks):
            assert all(i % 2 == r for batch in rank["bins"][kind][0] for i in batch)
        steps_of: dict[int, list[int]] = {}
        for rank in two_ranks:
            for step, batch in enumerate(rank["bins"][kind][0]):
                for i in batch:
                    steps_of.setdefault(i, []).append(step)
        # one bin per example, P = 4 steps apart
        assert all(steps == [steps[0], steps[0] + 4] for steps in steps_of.values()), steps_of


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_sharded_correlated_run_resumes_bit_for_bit(two_ranks, mechanism):
    for rank in two_ranks:
        runs = rank["resume"][mechanism]
        for name, weight in runs["straight"].items():
            assert torch.equal(weight, runs["resumed"][name]), f"{mechanism} {name}"


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_torchrun_without_sharding_is_refused(mechanism):
    from dptext.errors import UserError
    from dptext.privacy.sharding.distributed import DistributedContext

    model = nn.Linear(3, 2)
    with pytest.raises(UserError, match="train.sharding=fsdp"):
        engine_for(mechanism, model, torch.optim.SGD(model.parameters(), lr=1.0),
                   DistributedContext(rank=0, world_size=2))


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
