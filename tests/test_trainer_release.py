"""DPTrainer's release surface (issue 43): output_dir's release.json classifies every file the Trainer writes as
`dptext finetune` classifies its run directory, and the Trainer's statistics of the private batches (total_flos,
train_runtime, throughput, the per-step loss) are only in files listed not covered; a planted canary appears in
no covered or public file (the sweep of tests/test_canary_release.py, for the Trainer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import TrainingArguments  # noqa: E402

from dptext.integrations import DPTrainer, PrivacyArguments  # noqa: E402
from dptext.models import load_model  # noqa: E402

from canary_cases import integer_sequences  # noqa: E402
from test_hf_trainer import collate  # noqa: E402

pytestmark = pytest.mark.integration

CANARY = [211, 223, 227, 229, 233, 239, 241, 251]  # token ids no other row holds (the others draw from 3 … 199)
STATISTICS = ("total_flos", "train_runtime", "train_loss", "samples_per_second", "steps_per_second", '"loss"')


def rows(n: int = 24) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(3, 200, (int(torch.randint(3, 10, (1,), generator=generator)),),
                                        generator=generator).tolist()} for _ in range(n)]
    for row in data[::3]:  # the canary in every third record: most Poisson batches hold it
        row["input_ids"] = row["input_ids"][:2] + CANARY
    return data


def holds_canary(path: Path) -> bool:
    if path.suffix in (".pt", ".pth", ".bin"):
        loaded = torch.load(path, map_location="cpu", weights_only=False)
    elif path.suffix == ".json":
        loaded = json.loads(path.read_text())
    else:
        return False
    needle = CANARY[:4]
    return any(any(s[i:i + 4] == needle for i in range(len(s) - 3)) for s in integer_sequences(loaded))


def test_trainer_outputs_are_classified_and_statistics_only_in_not_covered_files(tmp_path):
    out = tmp_path / "out"
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, max_steps=2, logging_steps=1,
                             report_to=[], save_strategy="steps", save_steps=1, use_cpu=True, optim="sgd",
                             lr_scheduler_type="constant", learning_rate=0.1, disable_tqdm=True)
    model = load_model("tiny-llama", head="causal_lm", dtype=torch.float64)[0]
    privacy = PrivacyArguments(max_grad_norm=0.05, expected_batch_size=8, noise_multiplier=1.0)
    trainer = DPTrainer(model=model, args=args, train_dataset=rows(), data_collator=collate, privacy=privacy)
    output = trainer.train()
    assert "train_runtime" in output.metrics  # (total_flos is in the state only)
    for write in (trainer.save_model, trainer.save_state, lambda: trainer.save_metrics("train", output.metrics)):
        write()  # each of the Trainer's writers leaves release.json listing exactly the files there
        manifest = json.loads((out / "release.json").read_text())
        status = {f["path"]: f["status"] for f in manifest["files"]}
        on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
        assert set(status) == on_disk, sorted(on_disk ^ set(status))
    assert manifest["privacy_unit"]["unit"] == "example" and not manifest["flags"]
    for name in ("trainer_state.json", "checkpoint-1/trainer_state.json", "checkpoint-2/trainer_state.json",
                 "train_results.json", "all_results.json", "checkpoint-1/rng_state.pth"):
        assert status[name] == "not_covered", name
    for name in ("model.safetensors", "config.json", "privacy.json", "checkpoint-2/privacy.json",
                 "checkpoint-1/optimizer.pt"):
        assert status[name] == "covered", name
    flos = [json.loads((out / f"checkpoint-{s}" / "trainer_state.json").read_text())["total_flos"] for s in (1, 2)]
    assert flos[0] > 0 and flos[1] > flos[0]  # the statistic is there (the check below can bite) ...
    for name, state in status.items():  # ... and in no covered or public file, nor is the canary
        path = out / name
        if state == "not_covered" or name == "release.json":  # (the manifest names the statistics it files)
            continue
        if path.suffix == ".json":
            text = path.read_text()
            assert not any(word in text for word in STATISTICS), name
        assert not holds_canary(path), name
