"""The seeds of a run: the public root that seeds initialisation and dropout, the private one of sampler and noise,
the stable record ids eDP-SGD's keyed slot hash reads, and the generator states a checkpoint saves."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch

from dptext.errors import UserError
from dptext.privacy.noise.randomness import RandomRoot


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


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU and CUDA) generator states, for exact resumption."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
