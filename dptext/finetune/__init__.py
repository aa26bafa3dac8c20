"""DP fine-tuning (Li et al. 2021): ``run_finetune(recipe)`` is what ``dptext finetune`` calls.

``setup`` builds data, task, model, optimizer and the privacy engine from a recipe; ``loop`` is
the training loop with checkpoints; ``run`` ties them to a run directory and writes the result.
"""

from dptext.finetune.run import run_finetune

__all__ = ["run_finetune"]
