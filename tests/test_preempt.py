"""Preemption through the real step-1 program on 2 ranks, ZeRO-3: SIGTERM to the whole process group (as
srun and scancel deliver it) mid-run; every rank ends its step, one training state is saved and named, the
ranks exit 75; a requeued job (SLURM_RESTART_COUNT) resumes by itself and ends bit-identical to an
uninterrupted run. Also the signal names by hand."""

import json
import os
import signal
import subprocess
import time

import pytest

from rlhfkit.errors import ConfigError
from rlhfkit.preempt import install
from test_reliability import data, identical, sft_args  # noqa: F401 - data is a fixture
from testutils import REPO, VENV_BIN, env_for_ranks, free_port, run_program


def test_signal_names():
    old = signal.getsignal(signal.SIGUSR2)
    try:
        assert install("SIGUSR2") == [signal.SIGUSR2] and install("usr2") == [signal.SIGUSR2] and install("none") == []
    finally:
        signal.signal(signal.SIGUSR2, old)
    with pytest.raises(ConfigError, match="SIGKILL is not a signal that can be caught"):
        install("SIGKILL")
    with pytest.raises(ConfigError, match="SIGNOPE is not a signal"):
        install("SIGNOPE")


def train_steps(out):
    path = out / "logs" / "metrics.jsonl"
    if not path.exists():
        return 0
    return max([json.loads(x)["step"] for x in path.read_text().splitlines() if "train/loss" in x] or [0])


@pytest.mark.distributed
def test_sigterm_to_the_group_saves_and_a_requeued_job_resumes_exactly(tiny_dir, data, tmp_path):  # noqa: F811
    args = ["--max_steps", "30", "--save_interval", "0"]
    ref = tmp_path / "uninterrupted"
    run_program("step1_sft/main.py", sft_args(tiny_dir, data, ref, *args), nprocs=2)
    out = tmp_path / "preempted"
    cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), str(REPO / "step1_sft/main.py"),
           *sft_args(tiny_dir, data, out, *args)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env_for_ranks(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 300
    while train_steps(out) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)  # the launcher and both ranks, as a scheduler does
    stdout, stderr = proc.communicate(timeout=120)
    states = sorted((out / "training_state").iterdir())
    assert len(states) == 1, (stdout[-3000:], stderr[-3000:])
    step = int(states[0].name.split("_")[1])
    assert 2 <= step < 30 and train_steps(out) == step
    assert f"preempted by SIGTERM after step {step}: training state saved in {states[0]}" in stderr, stderr[-3000:]
    assert "SIGTERM received; saving a training state at the end of this step" in stdout
    assert "Traceback" not in stderr and proc.returncode != 0

    from rlhfkit.resume import verify_state

    assert verify_state(states[0]) is None  # complete, although the launcher sent a second SIGTERM during the save
    resumed = run_program("step1_sft/main.py", sft_args(tiny_dir, data, out, *args), nprocs=2,
                          env_extra={"SLURM_RESTART_COUNT": "1"})
    assert "SLURM_RESTART_COUNT=1: a requeued job, so --resume auto" in resumed.stdout
    assert f"continuing from {states[0]}" in resumed.stdout and identical(ref, out)
