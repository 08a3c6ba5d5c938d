"""Helpers for tests that launch the real programs."""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = (REPO / ".." / "shared" / "data").resolve()
HH = SHARED_DATA / "hh-rlhf-harmless-base" / "pairs.jsonl.gz"
VENV_BIN = Path(sys.executable).parent


def data_is_required() -> bool:
    """Whether a test that needs the real data must fail, not skip, when it is absent: under
    RLHFKIT_REQUIRE_DATA=1 (.ci/run sets it) or, unless RLHFKIT_REQUIRE_DATA says otherwise, under CI
    (set by CI services), where a skipped real-data test would hide that it never ran."""
    if "RLHFKIT_REQUIRE_DATA" in os.environ:
        return os.environ["RLHFKIT_REQUIRE_DATA"] == "1"
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require_data(path: Path) -> Path:
    """``path`` (a file or folder of the real data), or skip the test when it is absent; fail it
    instead where :func:`data_is_required`."""
    if path.exists():
        return path
    message = f"real data {path} is absent (it lives beside the checkout as ../shared/data)"
    if data_is_required():
        pytest.fail(f"{message}; CI or RLHFKIT_REQUIRE_DATA=1 forbids skipping the tests that need it", pytrace=False)
    pytest.skip(message)


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
                env_extra: dict | None = None, launcher: bool = False) -> subprocess.CompletedProcess:
    """Run ``script`` (a path relative to the repo) with ``nprocs`` ranks on a free port, or as a plain
    process when ``nprocs == 0``. The ranks are started here with the environment DeepSpeed's launcher
    gives them (:func:`start_ranks`), which saves its two extra interpreters (about 8 s a run);
    ``launcher=True`` goes through the real ``deepspeed`` launcher instead."""
    env = env_for_ranks(max(nprocs, 1))
    env.update(env_extra or {})
    port = free_port()
    if nprocs == 0:
        cmd = [sys.executable, str(REPO / script), *args]
    elif launcher:
        cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", str(nprocs), "--master_port", str(port), str(REPO / script), *args]
    else:
        cmd = [sys.executable, "-u", str(REPO / script), *args]  # each rank's, with its --local_rank
    try:
        if nprocs and not launcher:
            proc = start_ranks(cmd, nprocs, port, env, timeout)
        else:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        if nprocs:  # a killed rank leaves DeepSpeed's /dev/shm all-reduce buffers behind (RAM)
            for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
                os.unlink(path)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\nSTDOUT:\n{proc.stdout[-6000:]}\nSTDERR:\n{proc.stderr[-6000:]}")
    return proc


def start_ranks(cmd: list[str], nprocs: int, port: int, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``nprocs`` ranks of ``cmd`` (``[python, "-u", script, *args]``) on this node, as deepspeed/launcher/launch.py
    starts them: its environment, and ``--local_rank`` right after the script; they share one stdout and one stderr.
    Like launch.py, when a rank fails the others get SIGTERM, then SIGKILL 30 s later, and the first failure's code
    is returned."""
    env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nprocs), LOCAL_SIZE=str(nprocs),
               CROSS_RANK="0", CROSS_SIZE="1")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        procs = [subprocess.Popen([*cmd[:3], f"--local_rank={r}", *cmd[3:]], cwd=REPO,
                                  env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=out, stderr=err)
                 for r in range(nprocs)]
        returncode = wait_ranks(procs, time.monotonic() + timeout)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if returncode is None:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)


def wait_ranks(procs: list[subprocess.Popen], deadline: float) -> int | None:
    """The job's exit code once every rank has ended (a failed rank ends the others), or None when
    ``deadline`` passed first (every rank killed)."""
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            end_ranks(procs, grace=30.0)
            return failed[0]
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)
    end_ranks(procs, grace=0.0)
    return None


def end_ranks(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM every rank still running, then SIGKILL those still running ``grace`` seconds later."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    kill_at = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, kill_at - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def tiny_llama(dtype=None, **config):
    """A small random Llama built in memory (seed 0): vocabulary 100, hidden 32, one layer of 2 heads
    and 1 key/value head, pad 0, unless ``config`` says otherwise; in ``dtype`` when given."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, pad_token_id=0)
    model = LlamaForCausalLM(LlamaConfig(**{**base, **config}))
    return model if dtype is None else model.to(dtype)
