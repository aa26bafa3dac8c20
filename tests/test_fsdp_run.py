"""`torchrun --nproc_per_node 2 -m dptext finetune ... train.sharding=fsdp` end to end on CPU (gloo).

A tiny Llama (tied embeddings, RMSNorm) is fine-tuned privately with FSDP2 for 4 steps, checkpointed every 2:
its ledger's ε equals `dptext account` for the run's q, σ and steps; the checkpoints are sharded
(``torch.distributed.checkpoint``) and listed in release.json; the model folder is one ordinary Hugging Face
folder that loads without torch.distributed; a resume from the step-2 checkpoint reaches identical weights and
the same ledger. Refusals come before any data is read.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from conftest import SHARED_DATA
from two_ranks import run_process_group, torchrun_failure
from dptext import config
from dptext.errors import UserError

pytestmark = pytest.mark.integration
TIMEOUT = 900  # a loaded 2-core machine: one tiny run takes 35 s idle, minutes under load


def torchrun(*args: str, cwd: Path, stderr: bool = False) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "dptext", "finetune", *args]
    done = run_process_group(command, TIMEOUT, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, torchrun_failure(done)
    return done.stdout + done.stderr if stderr else done.stdout


def recipe_text(data: Path, privacy: str = "{target_epsilon: 8}", model: str = "tiny-llama") -> str:
    return (f"name: tiny\nmodel: {{name: {model}}}\n"
            f"data: {{dataset: e2e, path: {data / 'e2e_nlg'}, max_train_examples: 40, max_eval_examples: 4, "
            "max_length: 48}\ntask: {type: table_to_text}\neval: {split: validation, beam_size: 1, max_new_tokens: 4}\n"
            "train: {batch_size: 10, max_steps: 4, log_every: 1, checkpoint_every: 2, learning_rate: 0.001, "
            f"sharding: fsdp}}\nprivacy: {privacy}\n")


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared datasets not found at {SHARED_DATA} (set DPTEXT_SHARED_DATA)")
    root = tmp_path_factory.mktemp("fsdp")
    (root / "tiny.yaml").write_text(recipe_text(SHARED_DATA))
    torchrun(str(root / "tiny.yaml"), "--out", str(root / "run"), "--json", cwd=root)
    return root / "run"


def test_sharded_run_ledger_matches_dptext_account(sharded_run, capsys):
    from dptext.cli.app import main

    result = json.loads((sharded_run / "result.json").read_text())
    privacy = result["privacy"]
    assert privacy["mechanism"]["processes"] == 2 and "own shard" in privacy["mechanism"]["noise"]
    ledger = json.loads((sharded_run / "ledger.json").read_text())
    assert ledger["steps"] == 4
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["account", "--sigma", repr(privacy["noise_multiplier"]), "--sample-rate", repr(privacy["sample_rate"]),
              "--steps", "4", "--delta", repr(privacy["delta"]), "--method", "rdp", "--json"])
    reported = json.loads(capsys.readouterr().out)["results"][0]
    assert reported["epsilon"] == pytest.approx(ledger["epsilon"]["rdp"]["epsilon"], rel=1e-12)
    assert reported["epsilon"] == pytest.approx(8.0, rel=1e-3)


def test_sharded_checkpoints_are_listed_and_the_model_folder_is_ordinary(sharded_run):
    import torch
    from transformers import AutoModelForCausalLM

    manifest = json.loads((sharded_run / "release.json").read_text())
    listed = {f["path"]: f["status"] for f in manifest["files"]}
    on_disk = {p.relative_to(sharded_run).as_posix() for p in sharded_run.rglob("*") if p.is_file()}
    assert set(listed) == on_disk
    shards = [p for p in listed if ".dcp/" in p]
    assert {p.rsplit("/", 1)[1] for p in shards} == {"__0_0.distcp.pt", "__1_0.distcp.pt", "metadata.pt"}
    assert all(listed[p] == "not_covered" for p in shards)
    model = AutoModelForCausalLM.from_pretrained(sharded_run / "model")  # one process, no torch.distributed
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    assert all(torch.isfinite(p).all() for p in model.parameters())


def resume_from_step_2(run: Path, tmp_path: Path) -> Path:
    """A copy of the 4-step ``run`` as if it had stopped after its step-2 checkpoint, resumed with torchrun."""
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    (resumed / "result.json").unlink()
    (resumed / "checkpoints" / "step-00000004.pt").unlink()
    shutil.rmtree(resumed / "checkpoints" / "step-00000004.dcp")
    (resumed / "checkpoints" / "LATEST").write_text("step-00000002.pt\n")
    shutil.rmtree(resumed / "model")
    torchrun("--resume", str(resumed), cwd=tmp_path)
    return resumed


@pytest.mark.slow  # a second torchrun run: about 40 s on a loaded 2-core machine
def test_sharded_resume_reaches_identical_weights_and_ledger(sharded_run, tmp_path):
    from safetensors.torch import load_file

    resumed = resume_from_step_2(sharded_run, tmp_path)
    straight, again = load_file(sharded_run / "model" / "model.safetensors"), load_file(resumed / "model" /
                                                                                        "model.safetensors")
    assert sorted(straight) == sorted(again)
    assert all((straight[k] == again[k]).all() for k in straight), "the resumed run's weights differ"
    ledger = json.loads((sharded_run / "ledger.json").read_text())
    assert json.loads((resumed / "ledger.json").read_text())["runs"] == ledger["runs"]


@pytest.mark.slow
def test_sharded_non_private_baseline_trains(shared_data, tmp_path):
    (tmp_path / "tiny.yaml").write_text(recipe_text(shared_data, "{enabled: false}"))
    torchrun(str(tmp_path / "tiny.yaml"), "--out", str(tmp_path / "run"), cwd=tmp_path)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert not result["privacy"]["private"] and result["steps_run"] == 4


@pytest.mark.slow
def test_sharded_ghost_run_ends_where_the_bookkeeping_run_does(shared_data, tmp_path):
    """Two runs with the same seeded noise and sampler, ghost and book-keeping: the same clipped sums, so the same
    weights (up to rounding) and the same ledger."""
    import torch
    from safetensors.torch import load_file

    (tmp_path / "tiny.yaml").write_text(recipe_text(shared_data, "{target_epsilon: 8, reproducible_noise: true}"))
    runs = {}
    for mode in ("ghost", "bookkeeping"):
        torchrun(str(tmp_path / "tiny.yaml"), f"privacy.clipping_mode={mode}", "--out", str(tmp_path / mode),
                 cwd=tmp_path)
        runs[mode] = load_file(tmp_path / mode / "model" / "model.safetensors")
        assert json.loads((tmp_path / mode / "result.json").read_text())["privacy"]["clipping_mode"] == mode
    assert sorted(runs["ghost"]) == sorted(runs["bookkeeping"])
    for name, weight in runs["ghost"].items():
        assert torch.allclose(weight, runs["bookkeeping"][name], atol=1e-5), name
    ledgers = [json.loads((tmp_path / mode / "ledger.json").read_text()) for mode in runs]
    assert ledgers[0]["steps"] == ledgers[1]["steps"] == 4
    assert ledgers[0]["epsilon"] == ledgers[1]["epsilon"]


@pytest.mark.slow  # a second torchrun run
def test_sharded_run_from_a_saved_folder_reads_only_each_ranks_rows(shared_data, tmp_path):
    """A Hugging Face folder as model.name takes the meta-device path (dptext.finetune.meta_load) end to end."""
    from dptext.models import load_model

    model, tokenizer = load_model("tiny-llama")
    model.save_pretrained(tmp_path / "saved")
    tokenizer.save_pretrained(tmp_path / "saved")
    (tmp_path / "tiny.yaml").write_text(recipe_text(shared_data, model=str(tmp_path / "saved")))
    log = torchrun(str(tmp_path / "tiny.yaml"), "--out", str(tmp_path / "run"), cwd=tmp_path, stderr=True)
    assert "each rank reads only its own rows from" in log
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["steps_run"] == 4 and result["privacy"]["private"]


@pytest.mark.parametrize("override, expected", [
    ("privacy.method=edp_sgd", "privacy.method=dp_sgd"),
    (None, "--nproc_per_node N"),
])
def test_sharding_refuses_what_it_cannot_keep_exact(override, expected, shared_data, tmp_path):
    from dptext.finetune.sharding import check_sharding

    (tmp_path / "tiny.yaml").write_text(recipe_text(shared_data))
    recipe = config.load_recipe(tmp_path / "tiny.yaml", [override] if override else [])
    with pytest.raises(UserError, match=expected.replace(".", r"\.")):
        check_sharding(recipe, 2 if override else 1, probe_now=True)


def test_sharded_ghost_is_accepted_and_refused_only_where_fsdp2_cannot_sum(shared_data, tmp_path, monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    from dptext.finetune.sharding import check_sharding

    (tmp_path / "tiny.yaml").write_text(recipe_text(shared_data))
    recipe = config.load_recipe(tmp_path / "tiny.yaml", ["privacy.clipping_mode=ghost"])
    check_sharding(recipe, 2, probe_now=True)  # this torch's FSDP2 can: accepted
    monkeypatch.delattr(FSDPModule, "set_force_sum_reduction_for_comms")
    with pytest.raises(UserError, match="FSDP2 has no set_force_sum_reduction_for_comms"):
        check_sharding(recipe, 2, probe_now=True)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_proof_runs_sharded_under_either_policy_and_before_fully_shard_on_half_stored_weights(precision,
                                                                                                 shared_data,
                                                                                                 tmp_path):
    # the engine on the sharded model proves itself, every rank together (proof.sharded_probe), a bf16 policy too
    # (weights gathered as stored for the probe: privacy.sharding.fsdp_precision); weights stored in bf16 would
    # carry their rounding into the sharded comparison: rank 0 proves them before fully_shard
    import torch

    from dptext.finetune.sharding import proven_before_sharding

    (tmp_path / "tiny.yaml").write_text(recipe_text(shared_data))
    recipe = config.load_recipe(tmp_path / "tiny.yaml", [f"train.precision={precision}"])
    model = torch.nn.Linear(2, 2)
    assert proven_before_sharding(recipe, torch.device("cpu"), model) is False
    assert proven_before_sharding(recipe, torch.device("cpu"), model.to(torch.bfloat16)) is True  # stored in bf16
    unverified = config.load_recipe(tmp_path / "tiny.yaml", [f"train.precision={precision}", "privacy.verify=false"])
    assert proven_before_sharding(unverified, torch.device("cpu"), model) is False
