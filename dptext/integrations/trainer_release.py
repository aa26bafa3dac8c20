"""What a DPTrainer's ``output_dir`` releases: ``release.json``, the same classification ``dptext finetune`` writes
for its run directory (``dptext.release``, kind ``trainer``), kept current whenever the Trainer writes there.

The Trainer's own statistics of the private batches — ``total_flos`` (with ``save_steps=1`` each checkpoint's value
recovers the tokens of every batch drawn), ``train_runtime`` and throughput, and the exact per-step loss in the log
history — live in ``trainer_state.json`` (each checkpoint's and the one ``save_state`` writes) and in the final
metrics ``save_metrics`` writes (``train_results.json``, ``all_results.json``): those files are listed not covered.
The same numbers in the metrics ``train()`` returns and in what the Trainer's loggers receive are not covered either
(docs/integrations.md says so); nothing in ``privacy.json``, the weights or the optimizer state carries them.
"""

from __future__ import annotations

import json
import os
from typing import Any

from dptext.runs import write_manifest

EXAMPLE_UNIT = {"unit": "example", "text": "ε is per example: one row of train_dataset"}


def trainer_flags(privacy: Any, sigma: float | None) -> list[str]:
    """Why the outputs might lack the guarantee (``dptext.release.FLAG_REASONS``)."""
    flags = ["no_noise"] if sigma == 0 else []
    return flags + (["seeded_noise"] if privacy.seed is not None else [])


def write_release(output_dir: str, privacy: Any, sigma: float | None) -> dict[str, Any]:
    """(Re)write ``output_dir/release.json`` listing every file there with its status."""
    return write_manifest(output_dir, "trainer", trainer_flags(privacy, sigma), EXAMPLE_UNIT)



def write_privacy_report(folder: str, report: dict[str, Any]) -> None:
    """``folder/privacy.json`` (atomically: a temp file, then rename)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "privacy.json")
    with open(path + ".tmp", "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2, default=str)
    os.replace(path + ".tmp", path)


class ReleaseListing:
    """The Trainer's own writers, each leaving output_dir's release.json listing what it wrote (a mixin before
    ``Trainer`` in DPTrainer's bases; ``engine``, ``privacy`` and ``args`` are DPTrainer's)."""

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        if not _internal_call:  # a checkpoint's save: the on_save callback lists the whole checkpoint
            self.refresh_release(output_dir)

    def save_state(self) -> None:
        super().save_state()
        self.refresh_release()

    def save_metrics(self, split, metrics, combined=True) -> None:
        super().save_metrics(split, metrics, combined)
        self.refresh_release()

    def refresh_release(self, *folders: str | None) -> None:
        """Rewrite release.json in output_dir (and in another folder the model was saved to)."""
        if self.engine is None or not self.args.should_save:
            return
        for folder in {self.args.output_dir, *(f for f in folders if f)}:
            if os.path.isdir(folder):
                write_release(folder, self.privacy, self.engine.noise_multiplier)
