"""glibc's allocator, set for training loops: keep freed memory for the next step instead of returning it.

A training step allocates and frees the same large tensors every time (activations, logits, per-layer gradients,
book-keeping's Grams). Under glibc's defaults every block above the dynamic mmap threshold (at most 32 MiB) is a
fresh ``mmap`` that is zero-filled a page at a time and unmapped when freed, so each step pays hundreds of
thousands of page faults: on SmolLM2-135M (T = 64, B = 8, 2 CPU cores) about 0.6–0.8 s of kernel time in a
3.3–4.3 s step. Serving every allocation from the heap and never trimming it makes those faults disappear and the
step about 14 % faster, for a peak RSS 3–14 % higher (``benchmarks/allocator_faults.py``, docs/performance.md;
MiniLM-L6, whose
tensors are smaller, gains 2–5 %). Freed memory then stays with the process, which is what a training loop wants
and why this is set by the ``dptext`` process entry point only, never by importing the library. What a one-off
phase freed (the start-up probe's float64 copy of the model) is handed back explicitly: ``release_freed_memory``.

A user who sets any of glibc's ``MALLOC_*`` variables has chosen for themselves and is left alone (``dptext
bench-memory`` reads peak memory that way), as is anyone who sets ``DPTEXT_ALLOCATOR=default``.
"""

from __future__ import annotations

import ctypes
import os
import sys

# mallopt(3) parameters, from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1  # -1 as the value: never give the top of the heap back to the OS
M_MMAP_MAX = -4  # 0 as the value: never serve an allocation with its own mmap


_applied = False  # whether this process's entry point set glibc to keep freed memory


def _malloc_variables() -> list[str]:
    return sorted(name for name in os.environ if name.startswith("MALLOC_"))


def _libc(function: str):
    """``function`` of the C library this process already runs on (Linux), or None (another OS, no such symbol)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None), function)
    except (OSError, AttributeError):
        return None


def user_has_chosen() -> bool:
    """Whether the environment already decides the allocator's behaviour."""
    return os.environ.get("DPTEXT_ALLOCATOR") == "default" or bool(_malloc_variables())


def keep_freed_memory() -> bool:
    """Set glibc to serve allocations from its heap and keep freed memory; whether it was set."""
    global _applied
    mallopt = None if user_has_chosen() else _libc("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; musl's stub returns 0 and changes nothing.
    _applied = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, -1) == 1
    return _applied


def setting() -> str:
    """How this process's allocator is set, for a run's provenance (it changes step times, never results)."""
    if _applied:
        return "freed memory kept (dptext.allocator)"
    chosen = _malloc_variables()
    if chosen:
        return "glibc, set by the environment: " + ", ".join(f"{name}={os.environ[name]}" for name in chosen)
    return "glibc defaults"


def release_freed_memory() -> None:
    """Give the OS back the free memory glibc holds (malloc_trim); a no-op elsewhere. For the end of a one-off
    phase that freed far more than the steps after it will use; the next allocations fault their pages in again."""
    trim = _libc("malloc_trim")
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        trim(0)
