"""The seeds of a run: the public root that seeds initialisation and dropout, the private one of sampler and noise,
and the stable record ids eDP-SGD's keyed slot hash reads."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch

from dptext.errors import UserError
from dptext.privacy.randomness import RandomRoot


def seed_everything(seed: int, child: str = "init", rank: int = 0) -> None:
    """Seed Python, NumPy and torch's global generators from the public root's ``child`` (init, then dropout,
    one stream per rank)."""
    value = RandomRoot(seed).seed(child, rank)
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)


def privacy_seed(privacy: Any, seed: int) -> int | None:
    """The seed of sampler and noise: None (a secret os.urandom root) unless reproducible noise was asked for."""
    if privacy.reproducible_noise and privacy.secure_rng:
        raise UserError("privacy.secure_rng re-seeds the noise from the OS every step, which contradicts "
                        "privacy.reproducible_noise=true; choose one.")
    return seed if privacy.reproducible_noise else None


def record_ids(examples: list) -> list[bytes]:
    """A stable id per encoded example (a digest of its tokens and labels), for eDP-SGD's keyed slot hash."""
    return [hashlib.blake2b(repr((e.input_ids, e.labels)).encode(), digest_size=16).digest() for e in examples]
