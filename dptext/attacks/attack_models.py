"""The three membership-inference attacks as functions of observed scores (no model code here).

* ``loss_attack`` (Yeom et al. 2018): member score = −loss.
* ``shadow_attack`` (Shokri et al. 2017, as in Dupuy et al. 2021 §4.2): a logistic regression learns
  member vs non-member from the shadow models' output features on their own members and non-members, then
  scores the target's outputs.
* ``lira_offline`` (Carlini et al. 2022, offline variant): for each audited point, the reference models (none
  trained on it) give OUT confidences φ; a Gaussian N(μ_x, σ²) is fitted to them and the one-sided test asks how
  far above the OUT distribution the target's φ lies: score = (φ_target − μ_x) / σ. With fewer than
  ``PER_EXAMPLE_VARIANCE_FROM`` references σ is one global standard deviation (LiRA's "fixed variance").
"""

from __future__ import annotations

import numpy as np

PER_EXAMPLE_VARIANCE_FROM = 16


def loss_attack(losses: np.ndarray) -> np.ndarray:
    return -np.asarray(losses, dtype=float)


class LogisticRegression:
    """L2-regularised logistic regression on standardised features, fitted by Newton's method (IRLS)."""

    def __init__(self, l2: float = 1e-2, iterations: int = 50):
        self.l2, self.iterations = l2, iterations

    def fit(self, features: np.ndarray, labels: np.ndarray) -> "LogisticRegression":
        x = np.asarray(features, dtype=float)
        self.mean, self.scale = x.mean(axis=0), x.std(axis=0) + 1e-12
        design = np.c_[np.ones(len(x)), (x - self.mean) / self.scale]
        y = np.asarray(labels, dtype=float)
        weights = np.zeros(design.shape[1])
        penalty = self.l2 * np.eye(design.shape[1])
        penalty[0, 0] = 0.0  # the intercept is not shrunk
        for _ in range(self.iterations):
            p = 1 / (1 + np.exp(-design @ weights))
            gradient = design.T @ (p - y) + penalty @ weights
            hessian = (design * (p * (1 - p))[:, None]).T @ design + penalty
            step = np.linalg.solve(hessian, gradient)
            weights -= step
            if np.max(np.abs(step)) < 1e-8:
                break
        self.weights = weights
        return self

    def decision_function(self, features: np.ndarray) -> np.ndarray:
        x = (np.asarray(features, dtype=float) - self.mean) / self.scale
        return self.weights[0] + x @ self.weights[1:]


def shadow_attack(shadow_features: np.ndarray, shadow_membership: np.ndarray,
                  target_features: np.ndarray) -> np.ndarray:
    """Member scores (log-odds) of the target's feature rows from a classifier fitted on the shadows'."""
    classifier = LogisticRegression().fit(shadow_features, shadow_membership)
    return classifier.decision_function(target_features)


def lira_offline(target_logits: np.ndarray, reference_logits: np.ndarray) -> np.ndarray:
    """``reference_logits``: (references, points) OUT confidences; returns one z-score per point."""
    target = np.asarray(target_logits, dtype=float)
    out = np.atleast_2d(np.asarray(reference_logits, dtype=float))
    mean = out.mean(axis=0)
    if out.shape[0] >= PER_EXAMPLE_VARIANCE_FROM:
        std = out.std(axis=0, ddof=1)
    elif out.shape[0] >= 2:
        std = np.full_like(mean, np.sqrt(np.mean(out.var(axis=0, ddof=1))))
    else:  # one reference: no spread to fit; fall back to the spread of the target's own scores
        std = np.full_like(mean, np.std(target - mean))
    return (target - mean) / np.maximum(std, 1e-8)
