"""Distributed DP training: 2 gloo processes on CPU against the single-process engine (SPEC §1, §4).

The engine-level checks run once in two worker processes (this file run as a script, with torchrun's
environment variables and a free port) and are compared here against single-process twins:
(a) the all-reduced clipped sum equals the single-process clipped sum of the same examples, per clipping mode
and for eDP-SGD; (b) the realised noise has the accounted std σ·C and is drawn once, on rank 0; (c) eDP-SGD's
noise is added in the scaled space (layer l: std α_l·C·z_t / M, decaying); the non-private all-reduce averages.
The end-to-end test launches `torchrun ... -m dptext finetune` and checks the one run directory, its ledger
against `dptext account --schedule`, and a resume to identical weights.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from two_ranks import FAILURES, fails_on_rank_1, run_process_group, run_two_ranks, torchrun_failure

N, C = 12, 1.0
MODES = ("bookkeeping", "ghost", "per_sample")
EDP_ALPHAS = (0.5, 2.0, 3.0, 0.25)
TIMEOUT = 600  # a hang fails the test instead of blocking CI (a loaded 2-core machine needs minutes)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def data():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(N, 8, generator=generator) * 3, torch.randn(N, 4, generator=generator)


def losses(model, x, y):
    return ((model(x) - y) ** 2).sum(dim=1)


def sgd(model):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)


def dp_clipped_sum(mode: str, ctx=None, indices=None):
    """Σ of the clipped per-example gradients of ``indices`` (all ranks' when distributed), via the optimizer."""
    from dptext.privacy import PrivacyEngine

    model = mlp()
    engine = PrivacyEngine(model, sgd(model), noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=N,
                           dataset_size=N, clipping_mode=mode, distributed=ctx, verify=False)
    x, y = data()
    indices = list(range(N)) if indices is None else indices
    engine.accumulate(losses(model, x[indices], y[indices]))
    return [g * N for g in engine.dp_optimizer.privatized_grads().values()]


def record_ids(n):
    return [f"record-{i}".encode() for i in range(n)]


def edp_gradient(ctx=None, per_device=1):
    """eDP-SGD's gradient without noise: Σ_slots α·clip(Δ_m/α) / M over the examples this process owns (slot
    = keyed hash of the record id under the reproducible root's key, broadcast from rank 0)."""
    from dptext.privacy.mechanisms.edp import EDPEngine

    model = mlp()
    alphas = dict(zip(model.parameters(), EDP_ALPHAS))
    engine = EDPEngine(model, sgd(model), noise_multiplier=0.0, max_grad_norm=C, sample_rate=1.0, dataset_size=N,
                       micro_batches_per_device=per_device, alphas=alphas, scaling="public", distributed=ctx,
                       seed=9, record_ids=record_ids(N), verify=False)
    x, y = data()
    mine = engine.shard()
    for unit in engine.clipping_units(list(range(N)) if mine is None else mine):
        engine.accumulate(losses(model, x[unit], y[unit]))
        engine.close_unit()
    return list(engine.dp_optimizer.privatized_grads().values())


def dp_noise(ctx=None):
    from dptext.privacy import PrivacyEngine

    torch.manual_seed(0)
    model = nn.Linear(400, 250)
    engine = PrivacyEngine(model, sgd(model), noise_multiplier=1.3, max_grad_norm=0.7, expected_batch_size=10,
                           dataset_size=100, seed=5, distributed=ctx, verify=False)
    return list(engine.dp_optimizer.privatized_grads().values())


EDP_NOISE = {"z0": 1.5, "C": 0.4, "alphas": (0.5, 1.0, 3.0, 2.0)}


def edp_noise_steps(ctx=None):
    """Parameter moves of two noise-only eDP steps (SGD, lr 1) with linear decay τ=1, one step per epoch."""
    from dptext.accounting.schedule import NoiseSchedule
    from dptext.privacy.mechanisms.edp import EDPEngine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 200), nn.Linear(200, 300))
    recorded = []
    engine = EDPEngine(model, sgd(model), noise_multiplier=EDP_NOISE["z0"], max_grad_norm=EDP_NOISE["C"],
                       sample_rate=0.5, dataset_size=100, alphas=dict(zip(model.parameters(), EDP_NOISE["alphas"])),
                       scaling="public", schedule=NoiseSchedule("linear", 1.0), steps_per_epoch=1, seed=3,
                       ledger=lambda sample_rate, noise_multiplier: recorded.append(noise_multiplier),
                       distributed=ctx, record_ids=record_ids(100))
    moves = []
    for _ in range(2):
        before = [p.detach().clone() for p in model.parameters()]
        engine.step()
        moves.append([b - p.detach() for b, p in zip(before, model.parameters())])
    return {"moves": moves, "recorded": recorded, "slots": engine.slots}


def refused_on_one_rank(ctx, mode: str, failure: str) -> dict:
    """Rank 1's check fails on its first micro-batch (forced; the data or hook that breaks it is on one rank only):
    both ranks go on to the step and both refuse it there, with nothing applied; the next step trains again."""
    from dptext.errors import UserError
    from dptext.privacy import PrivacyEngine

    model = mlp()
    engine = PrivacyEngine(model, sgd(model), noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=N,
                           dataset_size=N, clipping_mode=mode, distributed=ctx, verify=False)
    x, y = data()
    mine = ctx.shard(N)
    before = [p.detach().clone() for p in model.parameters()]
    with fails_on_rank_1(failure, ctx.rank, model):
        engine.accumulate(losses(model, x[mine[:3]], y[mine[:3]]))  # rank 1 refuses: nothing raised yet
    engine.zero_grad()  # a caller dropping the batch does not drop the refusal: it still surfaces at the step
    engine.accumulate(losses(model, x[mine[3:]], y[mine[3:]]))  # passes, but joins no refused batch
    try:
        engine.step()
        refusal = ""
    except UserError as error:
        refusal = str(error)
    unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    if ctx.rank == 0:  # mid-batch on rank 0 only: every rank refuses the re-plan together
        engine.accumulate(losses(model, x[mine[:2]], y[mine[:2]]))
    try:
        engine.replan(verify=False)
        replan = ""
    except UserError as error:
        replan = str(error)
    engine.zero_grad()
    engine.step(losses(model, x[mine], y[mine]))
    moved = not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    return {"refusal": refusal, "unchanged": unchanged, "next_step_moved": moved, "replan": replan}


def worker(out: Path) -> None:
    """One rank of the 2-process checks (this file run as a script with torchrun's environment)."""
    from dptext.finetune.distributed import current, release

    ctx = current("cpu")
    mine = ctx.shard(N)
    model = mlp()
    x, y = data()
    losses(model, x[mine], y[mine]).sum().backward()
    ctx.average_gradients(list(model.parameters()), len(mine))
    results = {
        "clipped": {mode: dp_clipped_sum(mode, ctx, mine) for mode in MODES},
        "edp": edp_gradient(ctx),
        "noise": dp_noise(ctx),
        "edp_noise": edp_noise_steps(ctx),
        "non_private": [p.grad for p in model.parameters()],
        "shard": mine,
        "refused": {(mode, failure): refused_on_one_rank(ctx, mode, failure)
                    for mode in ("bookkeeping", "ghost") for failure in FAILURES},
    }
    torch.save(results, out / f"rank{ctx.rank}.pt")
    release()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_two_ranks(__file__, tmp_path_factory.mktemp("ranks"), TIMEOUT)


def _assert_close(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.allclose(g, w, atol=1e-5, rtol=1e-5), f"{what}: parameter {i} off by {(g - w).abs().max():.3g}"


def test_shards_are_fixed_by_index_and_cover_the_data(two_ranks):
    assert two_ranks[0]["shard"] == list(range(0, N, 2)) and two_ranks[1]["shard"] == list(range(1, N, 2))


def test_ranks_poisson_sample_their_shards_independently_at_the_global_rate():
    from dptext.privacy.sharding.distributed import DistributedContext
    from dptext.privacy.sampling.sampler import make_sampler

    n, q, steps = 50, 0.3, 2000
    draws = []
    for rank in range(2):  # no process group needed: sampling is local to each rank
        ctx = DistributedContext(rank=rank, world_size=2)
        taken = torch.zeros(steps, n)
        for step, batch in enumerate(make_sampler(n, q, steps, seed=0, distributed=ctx)):
            assert all(i % 2 == rank for i in batch)
            taken[step, batch] = 1
        draws.append(taken)
    union = draws[0] + draws[1]
    assert union.max() == 1  # the shards are disjoint
    # each example joins with rate q (binomial sd 0.010; 0.06 is 6 sd) ...
    assert (union.mean(dim=0) - q).abs().max() < 0.06
    # ... independently of the other rank's examples (same generators would give correlation 1; sd here ≈ 0.005)
    pairs = torch.stack([draws[0][:, 0::2].flatten(), draws[1][:, 1::2].flatten()])
    assert abs(torch.corrcoef(pairs)[0, 1].item()) < 0.05


@pytest.mark.parametrize("mode", MODES)
def test_all_reduced_clipped_sum_equals_single_process(two_ranks, mode):
    single = dp_clipped_sum(mode)
    for rank in two_ranks:
        _assert_close(rank["clipped"][mode], single, f"{mode}")
    unclipped = mlp()
    x, y = data()
    losses(unclipped, x, y).sum().backward()
    assert any(not torch.allclose(s, p.grad, atol=1e-4) for s, p in zip(single, unclipped.parameters())), \
        "clipping was never active: the test would not see a clipping bug"


def test_edp_two_processes_equal_one_process_with_two_slots(two_ranks):
    single = edp_gradient(per_device=2)  # the same two hashed slots on one process = the two ranks' shards
    for rank in two_ranks:
        _assert_close(rank["edp"], single, "eDP")


def test_noise_std_is_the_accounted_sigma_c_drawn_once_on_rank_0(two_ranks):
    single = dp_noise()  # one process, same seed: rank 0 must draw exactly this noise, rank 1 none
    for rank in two_ranks:
        _assert_close(rank["noise"], single, "noise")
    weight = two_ranks[0]["noise"][0] * 10  # × B: the noise of the summed gradient, 100k coordinates
    # std error of a std from 100k normals ≈ 0.22%; 2% is 9 standard errors
    assert weight.std().item() == pytest.approx(1.3 * 0.7, rel=0.02)
    assert abs(weight.mean().item()) < 0.02


def test_edp_noise_is_added_in_the_scaled_space_and_decays(two_ranks):
    results = [rank["edp_noise"] for rank in two_ranks]
    for step in range(2):
        _assert_close(results[1]["moves"][step], results[0]["moves"][step], "eDP noise differs between ranks")
    z0, clip, slots = EDP_NOISE["z0"], EDP_NOISE["C"], results[0]["slots"]
    assert slots == 2
    for step, z_t in enumerate((z0, z0 / 2)):  # linear decay 1/(1+τt), τ=1, one step per epoch
        moves = results[0]["moves"][step]
        for index in (0, 2):  # the two weight matrices, 60k coordinates each, α = 0.5 and 3
            expected = EDP_NOISE["alphas"][index] * clip * z_t / slots
            assert moves[index].std().item() == pytest.approx(expected, rel=0.03), (step, index)
    assert results[0]["recorded"] == pytest.approx([z0 / 2, z0 / 4], rel=1e-12)  # σ_t = z_t / 2 in the ledger


@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("mode", ("bookkeeping", "ghost"))
def test_a_check_failed_on_one_rank_stops_every_rank_at_the_step_with_nothing_applied(two_ranks, mode, failure):
    mine, other = two_ranks[1]["refused"][mode, failure], two_ranks[0]["refused"][mode, failure]
    assert FAILURES[failure] in mine["refusal"]
    assert other["refusal"].startswith("Another process's per-step privacy check failed")
    for rank in (mine, other):
        assert rank["unchanged"] and rank["next_step_moved"]
        assert "middle of a logical batch" in rank["replan"]


def test_non_private_all_reduce_is_the_mean_gradient(two_ranks):
    model = mlp()
    x, y = data()
    (losses(model, x, y).sum() / N).backward()
    for rank in two_ranks:
        _assert_close(rank["non_private"], [p.grad for p in model.parameters()], "non-private mean")


# --------------------------------------------------------------------------- end to end under torchrun

def _torchrun(*args: str, cwd: Path) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "dptext", "finetune", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = run_process_group(command, TIMEOUT, cwd=cwd, env=env)
    assert done.returncode == 0, torchrun_failure(done)
    return done.stdout


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory):
    """A 2-process eDP-SGD `dptext finetune` (linear decay, first-step α), checkpointed every 2 of 6 steps."""
    data = Path(os.environ.get("DPTEXT_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
    if not (data / "sst2").is_dir():
        pytest.skip(f"shared datasets not found at {data} (set DPTEXT_SHARED_DATA)")
    root = tmp_path_factory.mktemp("torchrun")
    (root / "tiny.yaml").write_text(
        "name: tiny\nmodel: {name: tiny-bert}\n"
        f"data: {{dataset: sst2, path: {data / 'sst2'}, max_train_examples: 40, max_eval_examples: 8, "
        "max_length: 48}\ntask: {type: classification}\neval: {split: validation}\n"
        "train: {batch_size: 10, max_steps: 6, log_every: 1, checkpoint_every: 2, learning_rate: 0.001}\n"
        "privacy: {target_epsilon: 8, method: edp_sgd, noise_decay: linear, noise_decay_rate: 0.5, "
        "edp_scaling: first_step, edp_public_examples: 6}\n")
    _torchrun(str(root / "tiny.yaml"), "--out", str(root / "run"), "--json", cwd=root)
    return root


@pytest.mark.integration
def test_torchrun_finetune_writes_one_run_whose_ledger_matches_dptext_account(torchrun_run, capsys):
    from dptext.cli.app import main

    run = torchrun_run / "run"
    assert sorted(p.name for p in torchrun_run.iterdir()) == ["run", "tiny.yaml"]  # one run directory only
    names = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())
    assert not [n for n in names if n.split("/")[-1].startswith(".")], names  # no temp files left behind
    result = json.loads((run / "result.json").read_text())
    privacy = result["privacy"]
    assert privacy["mechanism"]["processes"] == 2 and privacy["mechanism"]["sensitivity_factor"] == 2
    ledger = json.loads((run / "ledger.json").read_text())
    assert ledger["mechanism"]["scaling_leaks"] and "NOT covered" in privacy["mechanism"]["guarantee"]
    assert ledger["steps"] == 6 and len(ledger["runs"]) == 2  # q = 1/4: epochs of 4 steps, σ decays after 4
    assert ledger["runs"][1]["noise_multiplier"] == pytest.approx(ledger["runs"][0]["noise_multiplier"] / 1.5)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["account", "--sigma", repr(privacy["noise_multiplier"]), "--sample-rate", repr(privacy["sample_rate"]),
              "--steps", "6", "--schedule", "linear:0.5", "--delta", repr(privacy["delta"]), "--method", "rdp",
              "--json"])
    reported = json.loads(capsys.readouterr().out)["results"][0]
    assert reported["epsilon"] == pytest.approx(ledger["epsilon"]["rdp"]["epsilon"], rel=1e-12)
    assert reported["epsilon"] == pytest.approx(8.0, rel=1e-3)


@pytest.mark.integration
def test_torchrun_resume_continues_every_rank_to_identical_weights(torchrun_run, tmp_path):
    run = torchrun_run / "run"
    straight = torch.load(run / "checkpoints" / "step-00000006.pt", weights_only=False)
    resumed = tmp_path / "resumed"  # the same run, as if it had stopped after its step-4 checkpoint
    shutil.copytree(run, resumed)
    (resumed / "result.json").unlink()
    (resumed / "checkpoints" / "step-00000006.pt").unlink()
    (resumed / "checkpoints" / "LATEST").write_text("step-00000004.pt\n")
    _torchrun("--resume", str(resumed), cwd=tmp_path)
    again = torch.load(resumed / "checkpoints" / "step-00000006.pt", weights_only=False)
    assert all(torch.equal(straight["model"][k], again["model"][k]) for k in straight["model"])
    ledger = json.loads((run / "ledger.json").read_text())
    assert json.loads((resumed / "ledger.json").read_text())["runs"] == ledger["runs"]


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
