"""One root of randomness with named children (STYLE habit 13).

Every random choice of a run comes from a child of one root, split by ``numpy.random.SeedSequence``'s hash
(``spawn_key`` = (child, rank)): the Poisson sampler, the DP noise, eDP-SGD's slot key, model initialisation and
dropout never share a stream, and neither do two ranks of a torchrun job. Equal or offset seeds are never used:
two torch generators seeded alike emit the same uniforms, and when the sampler and the noise shared one, the
noise of a step gave away which examples were in its batch (issue 21).

Two roots per run:

* the **public root** (``train.seed``): initialisation, dropout, data splits. Writing it to resolved.yaml is fine.
* the **secret root** (sampler, noise, eDP slot key): 128 bits from ``os.urandom`` by default, held only in
  memory and never written to the run directory. A resume continues bit-exactly from the generator *states* in
  the checkpoint, not from a seed. With ``reproducible_noise`` it is derived from the public seed instead (a
  different child, so still independent of initialisation), and the guarantee holds only while that seed is
  secret; artifacts say so.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import torch

CHILDREN = ("sampler", "noise", "edp_slots", "init", "dropout")
SECRET_CHILDREN = ("sampler", "noise", "edp_slots")
ROOT_BITS = 128

SECRET_NOTE = "secret: sampler and noise seeded from os.urandom, never written to the run directory"
REPRODUCIBLE_NOTE = ("reproducible: sampler and noise derived from train.seed; the guarantee holds only while "
                     "that seed stays secret (anyone who knows it can regenerate the noise and subtract it)")


def os_entropy() -> int:
    """A fresh 128-bit root from the operating system's cryptographic source."""
    return int.from_bytes(os.urandom(ROOT_BITS // 8), "little")


class RandomRoot:
    """A root seed and its named children; ``RandomRoot()`` draws a secret root from ``os.urandom``."""

    def __init__(self, entropy: int | None = None):
        self.secret = entropy is None
        self._entropy = os_entropy() if entropy is None else int(entropy)
        if self._entropy < 0:
            raise ValueError("a random root must be a non-negative integer")

    def __repr__(self) -> str:  # never print a secret root (logs are part of what a run reveals)
        return "RandomRoot(secret)" if self.secret else f"RandomRoot({self._entropy})"

    def child(self, name: str, rank: int = 0, stream: int = 0) -> np.random.SeedSequence:
        """The seed sequence of child ``name`` for process ``rank`` (and ``stream``, e.g. one per device):
        independent of every other (name, rank, stream)."""
        if name not in CHILDREN:
            raise ValueError(f"unknown random child '{name}'; one of {', '.join(CHILDREN)}")
        return np.random.SeedSequence(self._entropy, spawn_key=(CHILDREN.index(name), int(rank), int(stream)))

    def seed(self, name: str, rank: int = 0, stream: int = 0) -> int:
        """A 63-bit integer seed for child ``name`` (for torch.manual_seed and random.seed)."""
        words = self.child(name, rank, stream).generate_state(2, np.uint32)
        return (int(words[0]) | (int(words[1]) << 32)) & ((1 << 63) - 1)

    def generator(self, name: str, rank: int = 0, device: str | torch.device = "cpu",
                  stream: int = 0) -> torch.Generator:
        """A torch generator on ``device`` seeded from child ``name`` (and ``rank``, ``stream``)."""
        return torch.Generator(device=device).manual_seed(self.seed(name, rank, stream))

    def key(self, name: str) -> bytes:
        """A 32-byte key for keyed hashing (eDP-SGD's slot assignment), from child ``name``."""
        return self.child(name).generate_state(8, np.uint32).tobytes()


def keyed_hash(key: bytes, data: bytes) -> int:
    """A 64-bit pseudo-random function of ``data`` under ``key`` (BLAKE2b in keyed mode)."""
    return int.from_bytes(hashlib.blake2b(data, key=key, digest_size=8).digest(), "little")


def as_root(seed: "int | RandomRoot | None") -> RandomRoot:
    """``seed`` as a root: a RandomRoot as is, an integer as a reproducible root, None as a secret one."""
    return seed if isinstance(seed, RandomRoot) else RandomRoot(seed)


def randomness_note(root: RandomRoot) -> str:
    return SECRET_NOTE if root.secret else REPRODUCIBLE_NOTE
