"""DistilDP (Flemings & Annavaram; SPEC §6): DP synthetic text from a DP teacher, and distillation into a student.

``synthesize`` (``dptext synth``) samples control-coded text from a finished DP teacher run;
``run_distill`` (``dptext distill``) trains a student on it with the KD loss, or runs one of the
paper's baselines (DP-SGD student, DPKD, synthetic data only, zero-shot) for comparison.
"""

from __future__ import annotations

from dptext.distill.run import run_distill
from dptext.distill.synth import synthesize

__all__ = ["synthesize", "run_distill"]
