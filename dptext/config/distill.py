"""The ``distill`` section of a recipe: teacher, synthetic data, student and the distillation loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from dptext.config.fields import doc


@dataclass
class DistillConfig:
    """`dptext distill` (DistilDP, SPEC §6): a student learns from a DP teacher's synthetic data and soft labels.

    The recipe's ``data`` section names the private data (the baselines train on it; every method reports the
    student's perplexity on its ``eval.split``), ``train`` the student's optimisation, and ``privacy`` the
    budget of the DP baselines (dp_sgd: all of it; dpkd: what the teacher left, by basic composition)."""

    method: Literal["distildp", "synthetic_only", "dp_sgd", "dpkd", "zero_shot"] = doc(
        "distildp", "distildp: non-private KD on the teacher's synthetic data (ε inherited); synthetic_only: the "
        "same with kd_lambda=0; dp_sgd: DP-SGD on the student alone on the private data; dpkd: DP-SGD on the KD "
        "objective on the private data with a teacher trained on part of the budget; zero_shot: no training.")
    teacher: Optional[str] = doc(None, "Finished `dptext finetune` run directory of the DP teacher (for dpkd: the "
                                 "teacher trained with its share of the budget).")
    synthetic: Optional[str] = doc(None, "Folder written by `dptext synth` from this teacher (distildp, "
                                   "synthetic_only).")
    max_synthetic_examples: Optional[int] = doc(None, "Train on only the first N synthetic training records.", ge=1)
    student: Optional[str] = doc(None, "Student model: hub name (distilgpt2), local folder or offline alias; empty "
                                 "means the teacher's base model (recipe model.name of the teacher run).")
    student_layers: list = doc([], "Keep only these decoder layers of the student model (0-based), e.g. [2, 5, 8]; "
                               "embeddings, final norm and head are kept (tied weights stay tied).")
    student_layer_stride: Optional[int] = doc(None, "Keep every N-th decoder layer counted from the top (the last "
                                              "layer is kept); e.g. 3 turns SmolLM2-135M's 30 layers into 10.", ge=1)
    kd_lambda: float = doc(
        0.4, "λ: weight of the distillation term, L = (1−λ)·CE + λ·t²·KL(teacher‖student).", ge=0, le=1)
    temperature: float = doc(1.0, "t: softmax temperature of the distillation term.", gt=0)
    hidden_alpha: float = doc(0.0, "α: weight of the MSE between last hidden states (teacher and student hidden "
                              "sizes must match).", ge=0)
