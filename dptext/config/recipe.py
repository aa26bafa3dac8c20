"""The whole recipe: the sections in the order a recipe file lists them."""

from __future__ import annotations

from dataclasses import dataclass

from dptext.config.audit import AuditConfig
from dptext.config.data import DataConfig
from dptext.config.distill import DistillConfig
from dptext.config.fields import doc, section
from dptext.config.model import ModelConfig
from dptext.config.privacy import PrivacyConfig
from dptext.config.task import TaskConfig
from dptext.config.train import EvalConfig, TrainConfig


@dataclass
class Recipe:
    name: str = doc("recipe", "Run name; the run directory is runs/<name>-<timestamp>/.")
    description: str = doc("", "One line saying what this recipe reproduces or does.")
    model: ModelConfig = section(ModelConfig, "The model.")
    data: DataConfig = section(DataConfig, "The dataset.")
    task: TaskConfig = section(TaskConfig, "The objective.")
    privacy: PrivacyConfig = section(PrivacyConfig, "Differential privacy settings.")
    train: TrainConfig = section(TrainConfig, "Optimisation.")
    eval: EvalConfig = section(EvalConfig, "Evaluation.")
    distill: DistillConfig = section(DistillConfig, "`dptext distill`: teacher, synthetic data, student, λ, t, α.")
    audit: AuditConfig = section(AuditConfig, "Privacy auditing: the audit split and canaries.")
