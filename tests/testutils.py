"""Helpers for tests that launch the real programs."""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = (REPO / ".." / "shared" / "data").resolve()
HH = SHARED_DATA / "hh-rlhf-harmless-base" / "pairs.jsonl.gz"
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for_ranks(nprocs: int) -> dict:
    env = dict(os.environ)
    threads = str(max(1, (os.cpu_count() or 2) // nprocs))
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def run_program(script: str, args: list[str], nprocs: int = 1, timeout: int = 900, check: bool = True,
                env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``script`` (a path relative to the repo) with ``nprocs`` ranks under the deepspeed
    launcher on a free port, or as a plain process when ``nprocs == 0``."""
    env = env_for_ranks(max(nprocs, 1))
    env.update(env_extra or {})
    if nprocs == 0:
        cmd = [sys.executable, str(REPO / script), *args]
    else:
        cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", str(nprocs), "--master_port", str(free_port()), str(REPO / script), *args]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        if nprocs:  # a killed rank leaves DeepSpeed's /dev/shm all-reduce buffers behind (RAM)
            for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{cmd[4]}_*"):
                os.unlink(path)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\nSTDOUT:\n{proc.stdout[-6000:]}\nSTDERR:\n{proc.stderr[-6000:]}")
    return proc
