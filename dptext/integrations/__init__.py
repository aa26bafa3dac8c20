"""DP training inside other people's training loops: Hugging Face ``Trainer`` (``DPTrainer``) and the launchers
it runs under (torchrun, accelerate launch). docs/integrations.md says what works and what is refused.

Importing it imports torch and transformers."""

from __future__ import annotations

from dptext.finetune.distributed import end_process_group
from dptext.integrations.hf_trainer import DPTrainer, EngineStep, PrivacyArguments

__all__ = ["DPTrainer", "EngineStep", "PrivacyArguments", "end_process_group"]
