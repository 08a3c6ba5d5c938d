"""rlhfkit.host_memory: freed host memory stays in the process for the next step (glibc), on request only."""

import os
import platform
import subprocess
import sys

import pytest

from rlhfkit.errors import ConfigError

# Allocates 256 MiB in 4 MiB blocks (the size of a 135M model's MLP weight gradients in fp32) with
# libc's malloc, frees them and prints how much of it the process still holds (resident), in MiB. C
# calls only between the blocks (no torch), so that no small allocation of glibc's heap sits on top
# of them: with glibc's own thresholds it hands them back, deterministically.
PROBE = """
import ctypes, ctypes.util, os
from rlhfkit.host_memory import keep_freed_memory
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
print("set", keep_freed_memory())
before = resident_mib()
for _ in range(2):  # the second time as a training step would see it: glibc's dynamic thresholds have moved
    blocks = [libc.malloc(4 << 20) for _ in range(64)]
    for b in blocks:
        libc.memset(b, 1, 4 << 20)
    for b in blocks:
        libc.free(b)
print("kept", round(resident_mib() - before))
"""


def probe(env: dict) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True).stdout.split("\n")
    return out[0].split()[1], int(out[1].split()[1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_freed_memory_stays_in_the_process_only_when_asked():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    kept_set, kept = probe({**env, "RLHFKIT_KEEP_FREED_MEMORY": "1"})
    assert kept_set == "True" and kept >= 250, kept
    kept_set, kept = probe({**env, "RLHFKIT_KEEP_FREED_MEMORY": "0"})
    assert kept_set == "False" and kept < 16, kept
    # a user's own malloc settings win: nothing is changed
    assert probe({**env, "RLHFKIT_KEEP_FREED_MEMORY": "1", "MALLOC_TRIM_THRESHOLD_": "1000000"})[0] == "False"


def test_a_bad_setting_is_a_clear_error(monkeypatch):
    from rlhfkit.host_memory import keep_freed_memory

    monkeypatch.setenv("RLHFKIT_KEEP_FREED_MEMORY", "maybe")
    with pytest.raises(ConfigError, match=r"RLHFKIT_KEEP_FREED_MEMORY='maybe': use 1 \(keep freed memory in the process\) or 0"):
        keep_freed_memory()


# Which start-up call sets it: the programs' start_program (on the CPU), not dist.init (a process group only).
STARTUP = """
import sys
from dataclasses import dataclass

import rlhfkit.host_memory
from rlhfkit import distributed as dist
from rlhfkit.program import start_program

calls = []
rlhfkit.host_memory.keep_freed_memory = lambda: calls.append("set") or True


@dataclass
class Config:
    dist_timeout_s: int = 60
    seed: int = 1


dist.init(60)
print("dist.init", len(calls))
sys.argv = ["program"]
start_program(Config)
print("start_program", len(calls))
"""


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="on CUDA the tensors live in device memory: nothing to keep")
def test_programs_keep_freed_memory_from_start_program_not_from_dist_init():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", STARTUP], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("dist.init", "start_program"))]
    assert lines == ["dist.init 0", "start_program 1"], proc.stdout
