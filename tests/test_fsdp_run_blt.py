"""`torchrun --nproc_per_node 2 -m dptext finetune ... train.sharding=fsdp privacy.mechanism=blt` end to end on
CPU (gloo), a tiny Llama, 4 steps over 4 cyclic bins, checkpointed every 2: the run trains, its ledger says BLT
over 2 processes with the strategy's ε, the sharded checkpoints hold each rank's BLT buffers, and a resume from
the step-2 checkpoint reaches the straight run's weights bit for bit (the buffers put back from the checkpoint)."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import SHARED_DATA
from test_fsdp_run import recipe_text, resume_from_step_2, torchrun

pytestmark = pytest.mark.integration
PRIVACY = "{target_epsilon: 8, mechanism: blt, sampling: cyclic, blt_buffers: 2}"


@pytest.fixture(scope="module")
def blt_run(tmp_path_factory):
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared datasets not found at {SHARED_DATA} (set DPTEXT_SHARED_DATA)")
    root = tmp_path_factory.mktemp("fsdp-blt")
    (root / "tiny.yaml").write_text(recipe_text(SHARED_DATA, PRIVACY))
    torchrun(str(root / "tiny.yaml"), "--out", str(root / "run"), cwd=root)
    return root / "run"


def test_a_sharded_blt_run_trains_and_is_accounted_as_blt(blt_run):
    import torch.distributed.checkpoint as dcp

    result = json.loads((blt_run / "result.json").read_text())
    mechanism = result["privacy"]["mechanism"]
    assert mechanism["method"] == "blt" and mechanism["processes"] == 2 and mechanism["buffers"] == 2
    ledger = json.loads((blt_run / "ledger.json").read_text())
    assert ledger["steps"] == 4 and ledger["epsilon"]["rdp"]["epsilon"] == pytest.approx(8.0, rel=1e-3)
    strategy = json.loads((blt_run / "mf_strategy.json").read_text())
    assert strategy["separation"] == 4 and strategy["steps"] == 4  # 40 examples / batch 10: 4 bins
    folder = blt_run / "checkpoints" / "step-00000002.dcp"
    staging = folder.parent / "read-metadata"
    staging.mkdir()
    shutil.copy(folder / "metadata.pt", staging / ".metadata")
    saved = dcp.FileSystemReader(str(staging)).read_metadata().state_dict_metadata
    buffers = [key for key in saved if key.startswith("noise.")]
    assert buffers and all(key.endswith(("#0", "#1")) for key in buffers)  # d = 2 buffers per parameter


@pytest.mark.slow  # a second torchrun run
def test_a_sharded_blt_run_resumes_bit_for_bit(blt_run, tmp_path):
    from safetensors.torch import load_file

    resumed = resume_from_step_2(blt_run, tmp_path)
    straight = load_file(blt_run / "model" / "model.safetensors")
    again = load_file(resumed / "model" / "model.safetensors")
    assert sorted(straight) == sorted(again)
    assert all((straight[k] == again[k]).all() for k in straight), "the resumed run's weights differ"
