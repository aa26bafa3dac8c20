"""The start-up probe on a model FSDP2 gathers in bf16 (``dptext.privacy.sharding.fsdp_precision``): 2 gloo ranks.

With ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` (``dptext finetune``'s default on a GPU) the probe runs on
the sharded model itself, its weights gathered in fp32 for its duration; then the run's policy is back: training
gathers bf16 weights and its steps are bit for bit those of a model sharded in bf16 from the start whose engine
took the verdict without a probe; a forward that mixes examples only in bf16 is refused (the probe re-draws
examples once more with the policy's gathers). Weights stored in bf16 are refused in one sentence; ghost clipping
under a bf16 policy without a reduce dtype (FSDP2 then reduces the clipped sums in bf16) is refused at its first
micro-batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from fsdp_models import WIDTH, Block, TinyLM, full, losses, token_ids
from torch import nn
from two_ranks import run_two_ranks

C = 0.5
TIMEOUT = 180
MODES = ("bookkeeping", "ghost", "per_sample")


def policy(reduce_dtype=torch.float32):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)


def sharded_model(ctx, dtype=torch.float32, mp_policy=None):
    from dptext.finetune.sharding import shard_model

    torch.manual_seed(0)
    model = TinyLM().to(dtype)
    return shard_model(model, list(model.blocks), mp_policy or policy())


def engine_for(model, mode, ctx):
    from dptext.privacy import PrivacyEngine

    return PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.5), noise_multiplier=0.0, max_grad_norm=C,
                         expected_batch_size=4, dataset_size=12, clipping_mode=mode, distributed=ctx, verify=False)


def make_batch(examples, positions, generator):
    return {"input_ids": torch.randint(0, 11, (examples, positions), generator=generator)}


def probe_loss(model, batch):
    return losses(model, batch["input_ids"])


class GatheredDtypes:
    """The dtype of every all-gather FSDP2 makes (its unsharded parameters' storage), by phase."""

    def __init__(self):
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

        self.phase, self.seen, self.real = "", {}, FSDPParam.init_unsharded_param
        recorder = self

        def recording(param):
            recorder.real(param)
            recorder.seen.setdefault(recorder.phase, set()).add(str(param._unsharded_param.dtype))

        FSDPParam.init_unsharded_param = recording
        import dptext.privacy.proof.verify as verify

        self.check = verify.check_training_precision

        def checking(*args):  # the probe's last check runs in the training precision: its own phase
            before, recorder.phase = recorder.phase, "training precision check"
            try:
                return recorder.check(*args)
            finally:
                recorder.phase = before

        verify.check_training_precision = checking

    def close(self):
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

        import dptext.privacy.proof.verify as verify

        FSDPParam.init_unsharded_param, verify.check_training_precision = self.real, self.check


def trained(ctx, mode: str, prove: bool) -> dict:
    """Two noise-free steps on a bf16-policy model, proven on the sharded model first or taking the verdict."""
    from dptext.finetune.sharding import mark_verified

    dtypes = GatheredDtypes()
    try:
        model = sharded_model(ctx)
        engine = engine_for(model, mode, ctx)
        dtypes.phase = "probe"
        statuses = sorted({row["status"] for row in engine.verify(make_batch, probe_loss).table()}) if prove \
            else mark_verified(engine)
        dtypes.phase = "training"
        ids = token_ids()
        for step in range(2):
            engine.accumulate(losses(model, ids[4 * step:4 * step + 4]))
            engine.step()
        weights = {name: full(p).detach().clone() for name, p in model.named_parameters()}
        engine.detach()
    finally:
        dtypes.close()
    return {"statuses": statuses, "dtypes": dtypes.seen, "weights": weights}


def refused(action) -> str | None:
    from dptext.errors import UserError

    try:
        action()
    except UserError as error:
        return str(error)
    return None


def stored_in_bf16(ctx) -> str | None:
    model = sharded_model(ctx, torch.bfloat16, policy())
    return refused(lambda: engine_for(model, "bookkeeping", ctx).verify(make_batch, probe_loss))


def ghost_reduced_in_bf16(ctx) -> str | None:
    model = sharded_model(ctx, mp_policy=policy(reduce_dtype=None))
    engine = engine_for(model, "ghost", ctx)
    engine.verify(make_batch, probe_loss)  # gathered (and reduced) in fp32 during the probe: passes
    return refused(lambda: engine.accumulate(losses(model, token_ids()[:4])))


class MixingBlock(Block):
    """Every example's hidden state becomes example 0's where its gathered weights are bf16 (session-26 red team):
    the probe's fp32 gathers never take that path, training's do."""

    def forward(self, hidden):
        if self.fc.weight.dtype == torch.bfloat16:
            hidden = hidden[:1].expand_as(hidden) + 0 * hidden
        return super().forward(hidden)


class MixesInBf16(TinyLM):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([MixingBlock(WIDTH), MixingBlock(WIDTH)])


def mixed_in_bf16(ctx, mode: str) -> str | None:
    from dptext.finetune.sharding import shard_model

    torch.manual_seed(0)
    model = MixesInBf16().float()
    model = shard_model(model, list(model.blocks), policy())
    return refused(lambda: engine_for(model, mode, ctx).verify(make_batch, probe_loss))


def worker(out: Path) -> None:
    from dptext.finetune.distributed import current, release

    ctx = current("cpu")
    ctx.sharded = True
    results = {
        "runs": {(mode, prove): trained(ctx, mode, prove) for mode in MODES for prove in (True, False)},
        "stored": stored_in_bf16(ctx),
        "ghost_bf16_reduce": ghost_reduced_in_bf16(ctx),
        "mixed_in_bf16": {mode: mixed_in_bf16(ctx, mode) for mode in MODES},
    }
    torch.save(results, out / f"rank{ctx.rank}.pt")
    release()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_two_ranks(__file__, tmp_path_factory.mktemp("ranks"), TIMEOUT)


@pytest.mark.parametrize("mode", MODES)
def test_a_bf16_policy_model_is_proven_in_fp32_and_then_trains_in_bf16(two_ranks, mode):
    for rank in two_ranks:
        proven = rank["runs"][(mode, True)]
        assert proven["statuses"] == ["exact"], proven["statuses"]
        assert proven["dtypes"]["probe"] == {"torch.float32"}, proven["dtypes"]
        assert proven["dtypes"]["training precision check"] == {"torch.bfloat16"}, proven["dtypes"]
        assert proven["dtypes"]["training"] == {"torch.bfloat16"}, proven["dtypes"]


@pytest.mark.parametrize("mode", MODES)
def test_the_steps_after_the_proof_are_those_of_a_model_sharded_in_bf16_from_the_start(two_ranks, mode):
    for rank in two_ranks:
        proven, trusted = rank["runs"][(mode, True)]["weights"], rank["runs"][(mode, False)]["weights"]
        assert trusted.keys() == proven.keys()
        for name, value in trusted.items():
            assert torch.equal(proven[name], value), name
        start = sharded_start()
        assert any(not torch.equal(start[name], value) for name, value in trusted.items())  # the steps moved them


def sharded_start() -> dict:
    torch.manual_seed(0)
    return {name: p.detach() for name, p in TinyLM().named_parameters()}


def test_weights_stored_in_bf16_are_refused_in_one_sentence(two_ranks):
    for rank in two_ranks:
        assert rank["stored"] is not None and "stored in torch.bfloat16" in rank["stored"], rank["stored"]


def test_ghost_under_a_bf16_policy_without_a_reduce_dtype_is_refused(two_ranks):
    for rank in two_ranks:
        message = rank["ghost_bf16_reduce"]
        assert message is not None and "reduce dtype" in message, message


@pytest.mark.parametrize("mode", MODES)
def test_examples_mixed_only_in_the_policys_bf16_are_refused_on_every_rank(two_ranks, mode):
    for rank in two_ranks:
        message = rank["mixed_in_bf16"][mode]
        assert message is not None and "in the precision training runs in (bfloat16)" in message, message


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    worker(Path(sys.argv[1]))
