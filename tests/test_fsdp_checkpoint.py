"""Checkpoints of an FSDP2-sharded DP run (``dptext.finetune.sharded_checkpoint``), 2 gloo processes on CPU.

(a) A book-keeping run with Adam saved after one step and read back into a freshly built model, optimizer and
engine takes its second step to exactly the weights of the run that went straight on: the Adam moments and step
counts come back although book-keeping keeps every parameter out of autograd (torch restored an optimizer's state
only for parameters requiring grad, and the resumed run restarted Adam from step 0). (b) A save killed before
its rename leaves the checkpoint before it intact and readable; a step saved twice never removes the folder
that the first save's ``step-N.pt`` points to; folders of pruned steps and stale staging folders go.
The whole run (torchrun, resume from a step-2 checkpoint) is tests/test_fsdp_run.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_fsdp import C, N, VOCAB, full, losses, shard, tiny_lm, token_ids
from two_ranks import run_two_ranks

TIMEOUT = 240
SEED = 7


def dp_run(ctx):
    """A sharded tiny LM with Adam under the book-keeping engine (every parameter out of autograd)."""
    from dptext.privacy import PrivacyEngine

    model = shard(tiny_lm(), ctx)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine = PrivacyEngine(model, optimizer, noise_multiplier=1.0, max_grad_norm=C, expected_batch_size=N,
                           dataset_size=N, seed=SEED, distributed=ctx, verify=False)
    return SimpleNamespace(dist=ctx, model=model, optimizer=optimizer, engine=engine)


def dp_step(training, mine) -> None:
    training.engine.accumulate(losses(training.model, token_ids()[mine]))
    training.engine.step()


def weights(training) -> dict:
    return {name: full(p).detach().clone() for name, p in training.model.named_parameters()}


def adam_state(training) -> dict:
    names = {p: name for name, p in training.model.named_parameters()}
    return {names[p]: {key: full(value).clone() for key, value in state.items()}
            for p, state in training.optimizer.state.items()}


def resumed_step(ctx, mine, folder: Path) -> dict:
    """One step, a checkpoint, a second step; then the checkpoint read into a new run that takes the second step."""
    from dptext.finetune.sharded_checkpoint import load_weights, save_weights

    straight = dp_run(ctx)
    dp_step(straight, mine)
    name = save_weights(straight, folder, 1)
    saved_state, engine_state = adam_state(straight), straight.engine.state_dict()
    dp_step(straight, mine)
    resumed = dp_run(ctx)
    load_weights(resumed, folder, name)
    resumed.engine.load_state_dict(engine_state)
    restored_state = adam_state(resumed)
    frozen = [p.requires_grad for p in resumed.model.parameters()]
    dp_step(resumed, mine)
    return {"saved": saved_state, "restored": restored_state, "straight": weights(straight),
            "resumed": weights(resumed), "requires_grad_after_load": frozen}


class LateLayerLM(torch.nn.Module):
    """The tiny LM with one more layer that the forward pass skips until ``use_late`` is set: before that it gets
    no gradient, so a non-private Adam keeps no state for it."""

    def __init__(self):
        super().__init__()
        self.lm = tiny_lm()
        self.blocks = self.lm.blocks
        self.late = torch.nn.Linear(VOCAB, VOCAB).double()
        self.use_late = False

    def forward(self, input_ids):
        logits = self.lm(input_ids)
        return self.late(logits) if self.use_late else logits


def non_private_step(training, mine, use_late: bool) -> None:
    training.model.use_late = use_late
    losses(training.model, token_ids()[mine]).sum().backward()
    training.optimizer.step()
    training.optimizer.zero_grad()


def non_private_resume(ctx, mine, folder: Path) -> dict:
    """A non-private sharded Adam run saved while one layer had never had a gradient, read back, then a step that
    uses the layer: DCP refused the read (the fresh optimizer's state has entries the checkpoint lacks)."""
    from dptext.finetune.sharded_checkpoint import load_weights, save_weights

    def build():
        model = shard(LateLayerLM(), ctx)
        return SimpleNamespace(dist=ctx, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2))

    straight = build()
    non_private_step(straight, mine, use_late=False)
    name = save_weights(straight, folder, 1)
    saved_states = len(straight.optimizer.state)
    non_private_step(straight, mine, use_late=True)
    resumed = build()
    load_weights(resumed, folder, name)
    restored_states = len(resumed.optimizer.state)
    non_private_step(resumed, mine, use_late=True)
    return {"saved_states": saved_states, "restored_states": restored_states, "straight": weights(straight),
            "resumed": weights(resumed), "adam_straight": adam_state(straight), "adam_resumed": adam_state(resumed)}


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def interrupted_saves(ctx, mine, folder: Path) -> dict:
    """What the checkpoint folder holds after a complete save, a save killed inside DCP's write, a second
    complete save of the same step, and a later step's save once step 4's ``step-N.pt`` is pruned."""
    import torch.distributed.checkpoint as dcp

    from dptext.finetune.sharded_checkpoint import load_weights, save_weights

    training = dp_run(ctx)
    dp_step(training, mine)
    seen = {"first": save_weights(training, folder, 4)}
    if ctx.is_writer:
        (folder / "step-00000004.pt").write_bytes(b"the ordinary checkpoint that points to the first folder")
    saved = weights(training)
    dp_step(training, mine)  # the weights now differ from the ones saved
    complete_save = dcp.save

    def killed(state, checkpoint_id):  # every rank dies half-way through writing its shard
        Path(checkpoint_id).mkdir(parents=True, exist_ok=True)
        Path(checkpoint_id, f"__{ctx.rank}_0.distcp").write_bytes(b"half a shard")
        raise RuntimeError("killed")

    dcp.save = killed
    try:
        save_weights(training, folder, 4)
    except RuntimeError:
        seen["after_kill"] = listing(folder)
    finally:
        dcp.save = complete_save
    reader = dp_run(ctx)
    load_weights(reader, folder, seen["first"])
    seen["read_back_equal"] = all(torch.equal(saved[k], v) for k, v in weights(reader).items())
    seen["second"] = save_weights(training, folder, 4)
    seen["after_second"] = listing(folder)
    if ctx.is_writer:
        (folder / "step-00000004.pt").unlink()  # pruned by RunDir.save_checkpoint
    seen["later"] = save_weights(training, folder, 6)
    seen["after_later"] = listing(folder)
    return seen


def worker(out: Path) -> None:
    """One rank of the 2-process checks (this file run as a script with torchrun's environment)."""
    from dptext.finetune.distributed import current, release

    ctx = current("cpu")
    ctx.sharded = True
    mine = ctx.shard(N)
    folder = out / "checkpoints"  # the same folder on both ranks (one machine), as in a run directory
    results = {"resume": resumed_step(ctx, mine, folder / "resume"),
               "saves": interrupted_saves(ctx, mine, folder / "saves"),
               "non_private": non_private_resume(ctx, mine, folder / "non-private")}
    torch.save(results, out / f"rank{ctx.rank}.pt")
    release()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_two_ranks(__file__, tmp_path_factory.mktemp("ranks"), TIMEOUT)


def test_a_resumed_sharded_adam_step_reaches_the_straight_runs_weights(two_ranks):
    for rank in two_ranks:
        result = rank["resume"]
        assert set(result["restored"]) == set(result["saved"]) and len(result["saved"]) == 9  # tied: one state
        for name, saved in result["saved"].items():
            assert saved["step"].item() == 1
            for key, value in saved.items():
                assert torch.equal(result["restored"][name][key], value), (name, key)
        assert not any(result["requires_grad_after_load"])  # book-keeping's autograd flags are put back
        for name, value in result["straight"].items():
            assert torch.equal(result["resumed"][name], value), name


def test_a_killed_save_leaves_the_checkpoint_before_it_readable(two_ranks):
    saves = two_ranks[0]["saves"]
    assert saves["first"] == "step-00000004.dcp"
    assert saves["after_kill"] == [".step-00000004.2.dcp.tmp", "step-00000004.dcp", "step-00000004.pt"]
    assert all(rank["saves"]["read_back_equal"] for rank in two_ranks)
    assert saves["second"] == "step-00000004.2.dcp"  # the folder step-4.pt points to stays until it is pruned
    assert saves["after_second"] == ["step-00000004.2.dcp", "step-00000004.dcp", "step-00000004.pt"]
    assert saves["after_later"] == ["step-00000006.dcp"]


def test_a_non_private_resume_with_a_never_graded_layer_continues_the_straight_run(two_ranks):
    for rank in two_ranks:
        result = rank["non_private"]
        assert result["restored_states"] == result["saved_states"] == 9  # the tiny LM's; none for the late layer
        for name, value in result["straight"].items():
            assert torch.equal(result["resumed"][name], value), name
        assert result["adam_resumed"]["late.weight"]["step"].item() == 1  # Adam began on it after the resume
        for name, state in result["adam_straight"].items():
            for key, value in state.items():
                assert torch.equal(result["adam_resumed"][name][key], value), (name, key)


def test_optimizer_states_are_read_only_where_saved_and_every_saved_one_must_be_read():
    from dptext.errors import UserError
    from dptext.finetune.sharded_checkpoint import only_saved_states

    fresh = {"state": {"a.weight": {"step": 0, "exp_avg": 0}, "late.weight": {"step": 0, "exp_avg": 0}},
             "param_groups": [{"lr": 0.1}]}
    saved = {"optimizer.state.a.weight.step", "optimizer.state.a.weight.exp_avg", "optimizer.param_groups.a.weight.lr"}
    read = only_saved_states(fresh, saved)
    assert list(read["state"]) == ["a.weight"] and read["param_groups"] == fresh["param_groups"]
    with pytest.raises(UserError, match="optimizer.state.renamed.weight.step"):
        only_saved_states(fresh, saved | {"optimizer.state.renamed.weight.step"})


def test_a_resume_that_restores_fewer_optimizer_states_than_saved_refuses():
    from dptext.errors import UserError
    from dptext.finetune.sharded_checkpoint import _check_optimizer_restored

    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(UserError, match="0 of the checkpoint's 1 optimizer states"):
        _check_optimizer_restored(optimizer, {"state": {"weight": {"step": torch.tensor(1.0)}}})


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
