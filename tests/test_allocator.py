"""The allocator setting of the dptext entry point (dptext.allocator): large tensors come from the heap and stay
there, unless the user has chosen glibc's behaviour themselves; set by the process entry point only."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

from dptext import allocator
from dptext.cli import app

# In a fresh process: bytes glibc holds in mmapped blocks after a 64 MB tensor is allocated (mallinfo2's hblkhd).
PROBE = """
import ctypes, json, sys, torch
from dptext.allocator import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
applied = keep_freed_memory() if sys.argv[1] == "entry" else False
before = mallinfo2().hblkhd
block = torch.ones(64 * 2**20, dtype=torch.uint8)
print(json.dumps({"applied": applied, "mmapped": mallinfo2().hblkhd - before}))
"""


def glibc_with_mallinfo2() -> bool:
    try:
        return sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


def probe(setting: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "DPTEXT_ALLOCATOR"}
    done = subprocess.run([sys.executable, "-c", PROBE, setting], capture_output=True, text=True, check=True,
                          env={**clean, **env})
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not glibc_with_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_the_entry_setting_serves_a_large_tensor_from_the_heap():
    glibc = probe("glibc")
    assert not glibc["applied"] and glibc["mmapped"] >= 64 * 2**20  # the default: a block of its own
    kept = probe("entry")
    assert kept["applied"] and kept["mmapped"] == 0


@pytest.mark.skipif(not glibc_with_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
@pytest.mark.parametrize("env", [{"MALLOC_MMAP_THRESHOLD_": "131072"}, {"DPTEXT_ALLOCATOR": "default"}])
def test_a_user_choice_in_the_environment_is_left_alone(env):
    left = probe("entry", **env)
    assert not left["applied"] and left["mmapped"] >= 64 * 2**20


def test_user_has_chosen_reads_the_environment(monkeypatch):
    for name in [k for k in os.environ if k.startswith("MALLOC_")] + ["DPTEXT_ALLOCATOR"]:
        monkeypatch.delenv(name, raising=False)
    assert not allocator.user_has_chosen()
    monkeypatch.setenv("DPTEXT_ALLOCATOR", "kept")  # only "default" opts out
    assert not allocator.user_has_chosen()
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert allocator.user_has_chosen()


def test_only_the_process_entry_point_sets_the_allocator(monkeypatch):
    calls = []
    monkeypatch.setattr(app, "keep_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(sys, "argv", ["dptext", "--version"])
    with pytest.raises(SystemExit):
        app.main()
    assert calls == [1]
    with pytest.raises(SystemExit):
        app.main(["--version"])  # a call from Python (tests, notebooks) leaves the process's allocator alone
    assert calls == [1]


RELEASE = """
import json, torch
from dptext.allocator import keep_freed_memory, release_freed_memory

def rss_mb():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024

keep_freed_memory()
block = torch.ones(256 * 2**20, dtype=torch.uint8)
del block
kept = rss_mb()
release_freed_memory()
print(json.dumps({"kept": kept, "released": rss_mb()}))
"""


@pytest.mark.skipif(not glibc_with_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_release_gives_back_what_a_one_off_phase_freed():
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "DPTEXT_ALLOCATOR"}
    done = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, check=True, env=clean)
    rss = json.loads(done.stdout.strip().splitlines()[-1])
    assert rss["kept"] - rss["released"] > 200  # MB: the freed 256 MB block left the process


def test_provenance_records_the_allocator_setting(monkeypatch):
    from dptext.provenance import provenance

    for name in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(allocator, "_applied", False)
    assert provenance()["allocator"] == "glibc defaults"
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert provenance()["allocator"] == "glibc, set by the environment: MALLOC_ARENA_MAX=2"
    monkeypatch.setattr(allocator, "_applied", True)
    assert provenance()["allocator"] == "freed memory kept (dptext.allocator)"
