"""Gaussian noise for a whole model, drawn on all CPU cores (issue 19).

torch's CPU generator (Mersenne Twister) fills a tensor on one thread: on SmolLM2-135M the step's 135M draws
took ~1.2 s, most of book-keeping's overhead over non-private training at T=64, B=8. Here the noise of a group of
parameters is cut into fixed chunks of ``CHUNK`` coordinates; chunk j gets its own generator seeded with the j-th
of a vector of seeds drawn from the device generator in one call, and the chunks are filled on a thread pool
(torch releases the GIL inside the kernel). What each coordinate receives depends only on the device generator's
state and the parameters' shapes, never on the number of threads, so a resumed run (the device generator's state
is in the checkpoint) and a run on another machine draw the same noise. Each coordinate is drawn exactly once.

Other devices keep one ``normal_`` per tensor: their generators (Philox on CUDA) are already parallel.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

CHUNK = 1 << 20  # coordinates per chunk: ~5 ms of drawing, so the pool's overhead is negligible
SEED_LIMIT = (1 << 63) - 1

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads()), thread_name_prefix="dptext-noise")
        return _pool


def _fill(chunk: Tensor, std: float, seed: int) -> None:
    chunk.normal_(0.0, std, generator=torch.Generator().manual_seed(seed))


def normals(std: float, likes: list[Tensor], generator: torch.Generator) -> list[Tensor]:
    """One fresh fp32 tensor of N(0, std²) per tensor in ``likes`` (all on ``generator``'s device)."""
    out = [torch.empty(like.shape, device=like.device, dtype=torch.float32) for like in likes]
    if generator.device.type != "cpu":
        return [noise.normal_(0.0, std, generator=generator) for noise in out]
    chunks = [chunk for noise in out for chunk in noise.view(-1).split(CHUNK)]
    if not chunks:
        return out
    seeds = torch.randint(0, SEED_LIMIT, (len(chunks),), generator=generator, dtype=torch.int64).tolist()
    if len(chunks) == 1:
        _fill(chunks[0], std, seeds[0])
    else:
        list(_executor().map(_fill, chunks, [std] * len(chunks), seeds))  # list(): re-raises a worker's error
    return out
