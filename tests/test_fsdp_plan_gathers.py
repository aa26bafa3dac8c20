"""The engine's plan on an FSDP2 model gathers one unit at a time (``fsdp_controls.UnitAtATime``; issue 42): a rank
never holds the whole model while the engine is built, as a model loaded on the meta device never held it either.
2 gloo processes.

Checked on a 3-layer Llama sharded per decoder layer and at the root: while ``PrivacyEngine`` is built, at most one
unit is gathered at any moment and each unit is gathered exactly once (its RMSNorms are structural matches, confirmed
by running them on their gathered weights); the rules found are the one-process plan's; the probe then learns every
unit's unsharded parameters without another all-gather, and proves the model as one process does. (Before, the plan
gathered every unit at once: the whole model on every rank.) Where the engine will prove itself, copies of the plan's
gathers serve the probe's first pass (``cached_gathers.copies_from_the_plan``): with Adam's budget every unit's, so
the probe makes no real all-gather; with SGD the root's only; with verify=False none is kept.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_fsdp_redteam import outcome
from two_ranks import run_two_ranks

TIMEOUT = 240


def build():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return LlamaForCausalLM(config).double()


def plan(ctx=None, verify=False, optimizer="sgd") -> dict:
    """The rules per layer, the most units gathered at once and the gathers per unit while the engine is built,
    the gathers the probe's set-up makes, and the probe's statuses."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from dptext.privacy import PrivacyEngine
    from dptext.privacy.proof.verify import probe

    model = build()
    if ctx is not None:
        from dptext.finetune.sharding import shard_model

        shard_model(model)
    real_unshard, real_reshard = FSDPParamGroup.unshard, FSDPParamGroup.reshard
    gathered, most, gathers = set(), [0], []

    def unshard(self, *args, **kwargs):
        if self._all_gather_result is None and not self.is_unsharded:  # a real all-gather (else FSDP2's no-op)
            gathers.append(id(self))
            gathered.add(id(self))
            most[0] = max(most[0], len(gathered))
        return real_unshard(self, *args, **kwargs)

    def reshard(self, *args, **kwargs):
        gathered.discard(id(self))
        return real_reshard(self, *args, **kwargs)

    FSDPParamGroup.unshard, FSDPParamGroup.reshard = unshard, reshard
    try:
        make = torch.optim.Adam if optimizer == "adam" else torch.optim.SGD
        engine = PrivacyEngine(model, make(model.parameters(), lr=0.1), noise_multiplier=0.0,
                               max_grad_norm=1.0, expected_batch_size=4, dataset_size=100, distributed=ctx,
                               verify=verify)
        built = {"most": most[0], "gathers": sorted(gathers.count(each) for each in set(gathers)),
                 "groups": len(set(gathers)), "copies": len(getattr(engine, "plan_copies", None) or {})}
        gathers.clear()
        from dptext.privacy.proof import sharded_probe

        if ctx is not None:  # the probe's set-up reads every unit's unsharded parameters from FSDP2's records
            with sharded_probe.sharded_view(engine, model):
                built["setup_gathers"] = len(gathers)
        gathers.clear()
        verdict, report = outcome(lambda: probe(engine))
        built["probe_gathers"] = len(gathers)  # real all-gathers the probe made (the others served from copies)
        built["copies_after"] = getattr(engine, "plan_copies", None)
    finally:
        FSDPParamGroup.unshard, FSDPParamGroup.reshard = real_unshard, real_reshard
    built["rules"] = {engine.names[module]: type(rule).__name__ for module, (rule, _) in engine.tracked.items()}
    built["verdict"] = verdict
    built["table"] = {row["name"]: row["status"] for row in report.table()} if verdict == "ok" else report
    engine.detach()
    return built


def worker(out: Path) -> None:
    from dptext.finetune.distributed import current, release

    ctx = current("cpu")
    ctx.sharded = True
    cases = ((False, "sgd"), (True, "sgd"), (True, "adam"), ("rank 0 only", "adam"))
    torch.save({(verify, optimizer): plan(ctx, verify if verify != "rank 0 only" else ctx.rank == 0, optimizer)
                for verify, optimizer in cases}, out / f"rank{ctx.rank}.pt")
    release()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_two_ranks(__file__, tmp_path_factory.mktemp("ranks"), TIMEOUT)


def test_the_plan_gathers_one_unit_at_a_time_and_each_once(two_ranks):
    one_process = plan()
    assert one_process["groups"] == 0  # (nothing to gather in one process)
    for each in two_ranks:
        got = each[(False, "sgd")]
        assert got["most"] == 1, got  # never two units (let alone the whole model) at once
        assert got["groups"] == 4 and got["gathers"] == [1] * 4  # the root and three layers, each once
        assert got["setup_gathers"] == 0  # the probe learns the unsharded parameters without an all-gather
        assert got["rules"] == one_process["rules"]
        assert "RMSNormRule" in got["rules"].values()  # the structural matches, confirmed on gathered weights


def test_the_model_planned_unit_by_unit_is_proven_as_in_one_process(two_ranks):
    one_process = plan()
    for each in two_ranks:
        for got in each.values():
            assert got["verdict"] == "ok" and got["table"] == one_process["table"]


def test_the_plans_gathers_serve_the_probes_first_pass(two_ranks):
    for each in two_ranks:
        without = each[(False, "sgd")]  # verify=False: no probe expected, nothing kept
        root_only, everything = each[(True, "sgd")], each[(True, "adam")]
        assert without["copies"] == 0 and root_only["copies"] == 1  # SGD's budget: the root's copy only
        assert root_only["probe_gathers"] == without["probe_gathers"] - 1  # the root's first gather served
        assert everything["copies"] == 4 and everything["probe_gathers"] == 0  # Adam's budget: every unit's
        assert everything["gathers"] == [1] * 4 and everything["most"] == 1  # (the plan itself unchanged)
        assert all(got["copies_after"] is None for got in each.values() if got["copies"])  # dropped by the probe
    # ranks built with different verify settings, then proven together: rank 0 kept copies, rank 1 none; a copy is
    # used only where every rank holds one (its use is a collective), so both gather alike (no hang)
    first, second = two_ranks[0][("rank 0 only", "adam")], two_ranks[1][("rank 0 only", "adam")]
    assert first["copies"] == 4 and second["copies"] == 0
    assert first["probe_gathers"] == second["probe_gathers"] > 0 and first["verdict"] == second["verdict"] == "ok"


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
