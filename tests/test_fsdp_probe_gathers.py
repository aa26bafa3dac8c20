"""What the sharded start-up probe all-gathers (issue 42: its cost under FSDP2 is its all-gathers): 2 gloo processes.

The gathered parameters the probe follows are read from FSDP2's records without an all-gather (the same objects a
unit unsharded shows, and that the layers hold during a pass). With plain SGD (no optimizer state: no budget) the
root's gathers after its first are served from a copy (``proof.cached_gathers``) and every block is all-gathered
for each pass as FSDP2 alone does. Checked by counting FSDP2's real all-gathers per probe phase and unit, and
against the probe with no copies: the same report and the same step after it, in book-keeping, ghost and
per_sample; every unit resharded and FSDP2's settings after the probe those of the probe without. An evaluation
forward before the first training forward (it leaves FSDP2's root gathered) changes neither the proof nor the step.
"""

from __future__ import annotations

import collections
import contextlib
import sys
from pathlib import Path

import pytest
import torch
from fsdp_models import N, shard, tiny_lm, token_ids
from test_fsdp_probe import engine_for, make_batch, probe_loss
from test_fsdp_redteam import moves, outcome
from two_ranks import run_two_ranks

TIMEOUT = 240
MODES = ("bookkeeping", "ghost", "per_sample")


@contextlib.contextmanager
def counted_gathers():
    """{(shape, phase, unit): real all-gathers} while inside: FSDP2's unshard where it gathers (not its no-op
    calls on a unit already gathered), under the probe phase and shape (``probe_one``'s call number) running."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from dptext.privacy.proof import probe_checks, sharded_probe, verify

    counts, where = collections.Counter(), {"shape": -1, "phase": "other"}
    real_unshard = FSDPParamGroup.unshard

    def unshard(self, *args, **kwargs):
        if self._all_gather_result is None and not self.is_unsharded:
            counts[(where["shape"], where["phase"], self._module_fqn or "root")] += 1
        return real_unshard(self, *args, **kwargs)

    def phase(module, name, shape=False):
        real = getattr(module, name)

        def wrapped(*args, **kwargs):
            outer = dict(where)
            if shape:
                where["shape"] += 1
            else:
                where["phase"] = name
            try:
                return real(*args, **kwargs)
            finally:
                where["phase"] = outer["phase"]
        return real, wrapped

    patches = [(verify, "probe_one", True), (sharded_probe, "gathered_parameters", False),
               (verify, "check_whole_forward", False),
               (probe_checks, "reference_gradients", False), (probe_checks, "check_redrawn_examples", False)]
    originals = []
    FSDPParamGroup.unshard = unshard
    for module, name, shape in patches:
        real, wrapped = phase(module, name, shape)
        originals.append((module, name, real))
        setattr(module, name, wrapped)
    try:
        yield counts
    finally:
        FSDPParamGroup.unshard = real_unshard
        for module, name, real in originals:
            setattr(module, name, real)


@contextlib.contextmanager
def without_copies():
    """The probe as FSDP2 runs it alone: every gather of every unit an all-gather (no copies)."""
    from dptext.privacy.proof import verify

    saved = verify.cached_gathers
    verify.cached_gathers = lambda engine: contextlib.nullcontext()
    try:
        yield
    finally:
        verify.cached_gathers = saved


def settings(model) -> list:
    from dptext.privacy.sharding.fsdp_controls import param_groups

    return [(group.reshard_after_backward, group.post_forward_mesh_info) for _, group in param_groups(model)]


def probed(mode: str, ctx, keep: bool, make_engine=engine_for) -> dict:
    """The probe with copies (``keep``) or without: its report and gathers, FSDP2's state after it, the step."""
    model = shard(tiny_lm(), ctx)
    engine = make_engine(model, mode, ctx)
    with (contextlib.nullcontext() if keep else without_copies()), counted_gathers() as counts:
        table = engine.verify(make_batch, probe_loss).table()
    resharded = all(hasattr(param, "to_local") for param in model.parameters())
    after = [(flag, info is None) for flag, info in settings(model)]  # (FSDP2's first pass sets the root's info)
    step = moves(model, engine, token_ids()[ctx.shard(N)])
    engine.detach()
    return {"table": table, "gathers": dict(counts), "resharded": resharded, "settings": after,
            "step": step}


def same_objects(ctx) -> dict:
    """After the engine's plan: FSDP2's records give each unit's gathered parameters, the same objects as the unit
    unsharded shows, and the ones each layer holds in a pass."""
    from dptext.privacy.proof.sharded_probe import gathered_by_unsharding, gathered_parameters, kept_unsharded
    from dptext.privacy.sharding.fsdp_controls import fsdp_modules

    model = shard(tiny_lm(), ctx)
    engine = engine_for(model, "bookkeeping", ctx)
    with counted_gathers() as counts:
        found = gathered_parameters(model)
    kept = {unit: kept_unsharded(unit) for unit in fsdp_modules(model)}
    swept = {unit: gathered_by_unsharding(unit) for unit in fsdp_modules(model)}
    shards = {id(whole): shard for shard, whole in found.items()}
    held: list = []
    hooks = [module.register_forward_pre_hook(lambda module, args: held.append(module.weight))
             for module in engine.tracked if isinstance(module, torch.nn.Linear)]
    with torch.no_grad(), engine.recorder.paused():
        model(token_ids()[:2])
    for hook in hooks:
        hook.remove()
    for unit in fsdp_modules(model):
        unit.reshard()
    engine.detach()
    return {"gathers": sum(counts.values()), "none_missing": all(each is not None for each in kept.values()),
            "same_as_unsharded": all(kept[unit].keys() == swept[unit].keys() and all(
                kept[unit][shard] is swept[unit][shard] for shard in swept[unit]) for unit in kept),
            "every_shard": len(found) == len(list(model.parameters())),
            "held_in_a_pass": bool(held) and all(id(weight) in shards for weight in held)}


def evaluated_first(ctx, evaluate: bool) -> tuple:
    """The default proof at the first training forward, after an evaluation forward without a backward (which
    leaves FSDP2's root gathered) or without one: the outcome and the noise-free step's moves."""
    from dptext.privacy import PrivacyEngine

    model = shard(tiny_lm(), ctx)
    engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                           max_grad_norm=0.5, expected_batch_size=4, dataset_size=12, distributed=ctx,
                           probe_batch=make_batch, probe_loss=probe_loss)
    if evaluate:
        model.eval()
        with torch.no_grad():
            model(token_ids()[:2])
        model.train()
    got = outcome(lambda: moves(model, engine, token_ids()[ctx.shard(N)]))
    engine.detach()
    return got


def worker(out: Path) -> None:
    from dptext.finetune.distributed import current, release

    ctx = current("cpu")
    ctx.sharded = True
    results = {(mode, keep): probed(mode, ctx, keep) for mode in MODES for keep in (True, False)}
    results["objects"] = same_objects(ctx)
    results["evaluated_first"] = {evaluate: evaluated_first(ctx, evaluate) for evaluate in (True, False)}
    torch.save(results, out / f"rank{ctx.rank}.pt")
    release()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_two_ranks(__file__, tmp_path_factory.mktemp("ranks"), TIMEOUT)


def gathers(result: dict, shape: int, phase: str, unit: str) -> int:
    return result["gathers"].get((shape, phase, unit), 0)


def test_the_gathered_parameters_are_read_from_fsdp2_without_a_gather(two_ranks):
    for rank in two_ranks:
        assert rank["objects"] == {"gathers": 0, "none_missing": True, "same_as_unsharded": True,
                                   "every_shard": True, "held_in_a_pass": True}
        for mode in MODES:
            assert not any(phase == "gathered_parameters" for _, phase, _ in rank[(mode, True)]["gathers"])


def test_an_evaluation_forward_before_the_first_training_forward_changes_nothing(two_ranks):
    # it left FSDP2's root gathered, and the probe read the root's layers' gathered weights as their parameters:
    # a model it proves otherwise was refused (the reference failed, or "no gradient recorded" for the embedding)
    for rank in two_ranks:
        evaluated, straight = rank["evaluated_first"][True], rank["evaluated_first"][False]
        assert evaluated[0] == straight[0] == "ok", evaluated
        for name, move in straight[1].items():
            torch.testing.assert_close(evaluated[1][name], move, rtol=0, atol=0)


def unit_gathers(result: dict, unit: str) -> int:
    return sum(count for (_, _, name), count in result["gathers"].items() if name == unit)


@pytest.mark.parametrize("mode", MODES)
def test_the_root_is_gathered_once_for_the_whole_probe(two_ranks, mode):
    for rank in two_ranks:
        got, before = rank[(mode, True)], rank[(mode, False)]
        assert unit_gathers(got, "root") == 1, got["gathers"]  # the first pass; a copy serves the others
        assert gathers(got, 0, "other", "root") == 1
        assert unit_gathers(before, "root") > 4, before["gathers"]  # the control: FSDP2 gathers it for each pass


@pytest.mark.parametrize("mode", MODES)
def test_without_a_budget_every_block_is_gathered_as_fsdp2_alone_gathers_it(two_ranks, mode):
    for rank in two_ranks:
        got, before = rank[(mode, True)], rank[(mode, False)]
        for block in ("blocks.0", "blocks.1"):
            assert unit_gathers(got, block) == unit_gathers(before, block) > 4, (got["gathers"], before["gathers"])
        cut_away = [key for key in got["gathers"] if key[0] == 1 and key[2] == "blocks.1"]
        assert cut_away == [(1, "check_whole_forward", "blocks.1")], got["gathers"]  # the whole forward only


@pytest.mark.parametrize("mode", MODES)
def test_copied_gathers_change_neither_the_proof_nor_the_step_after_it(two_ranks, mode):
    for rank in two_ranks:
        got, before = rank[(mode, True)], rank[(mode, False)]
        assert got["table"] == before["table"]
        assert {row["status"] for row in got["table"]} == {"exact"}
        assert got["resharded"] and got["settings"] == before["settings"], (got["settings"], before["settings"])
        assert all(flag for flag, _ in got["settings"])
        for name, move in before["step"].items():
            torch.testing.assert_close(got["step"][name], move, rtol=0, atol=0)


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
