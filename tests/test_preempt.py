"""Preemption through the real programs (step 1, and step 3 with GRPO) on 2 ranks, ZeRO-3: SIGTERM to the
whole process group (as srun and scancel deliver it) mid-run; every rank ends its step, one training state is
saved and named, the ranks exit 75; a requeued job (SLURM_RESTART_COUNT) resumes by itself, and the run ends
bit-identical to an uninterrupted one. Also the signal names by hand."""

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
    return max([json.loads(x)["step"] for x in path.read_text().splitlines() if "train/loss" in x or "policy/loss" in x] or [0])


def preempt_mid_run(script, args, out):
    """Start ``script`` on 2 ranks in its own process group, SIGTERM the group once the logs show step 2; the
    state it saved (checked) and its step."""
    from rlhfkit.resume import verify_state

    cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), str(REPO / script), *args]
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
    assert step >= 2 and train_steps(out) == step
    assert f"preempted by SIGTERM after step {step}: training state saved in {states[0]}" in stderr, stderr[-3000:]
    assert "SIGTERM received; saving a training state at the end of this step" in stdout
    assert "Traceback" not in stderr and proc.returncode != 0
    assert verify_state(states[0]) is None  # complete, although the launcher sent a second SIGTERM during the save
    return states[0]


@pytest.mark.distributed
def test_sigterm_to_the_group_saves_and_a_requeued_job_resumes_exactly(tiny_dir, data, tmp_path):  # noqa: F811
    args = ["--max_steps", "30", "--save_interval", "0"]
    ref = tmp_path / "uninterrupted"
    run_program("step1_sft/main.py", sft_args(tiny_dir, data, ref, *args), nprocs=2)
    out = tmp_path / "preempted"
    state = preempt_mid_run("step1_sft/main.py", sft_args(tiny_dir, data, out, *args), out)
    assert int(state.name.split("_")[1]) < 30
    resumed = run_program("step1_sft/main.py", sft_args(tiny_dir, data, out, *args), nprocs=2,
                          env_extra={"SLURM_RESTART_COUNT": "1"})
    assert "SLURM_RESTART_COUNT=1: a requeued job, so --resume auto" in resumed.stdout
    assert f"continuing from {state}" in resumed.stdout and identical(ref, out)


@pytest.mark.distributed
def test_step3_preempted_mid_run_resumes_exactly(tiny_dir, reward_dir, tmp_path):
    """GRPO scored by the tiny reward model, 2 ranks, ZeRO-3, fp32: preempted, resumed, equal to the uninterrupted
    run (the actor moved)."""
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} plus {i}?", "answer": f"#### {2 * i}"}) + "\n"
                            for i in range(40)))

    def args(out):
        return ["--algo", "grpo", "--actor_model_name_or_path", str(tiny_dir), "--data_path", str(data), "--output_dir", str(out),
                "--reward_model_name_or_path", str(reward_dir), "--data_split", "0,0,1", "--eval_fraction", "0",
                "--max_prompt_seq_len", "48", "--max_answer_seq_len", "6", "--per_device_generation_batch_size", "1",
                "--per_device_training_batch_size", "2", "--n_samples_per_prompt", "2", "--max_steps", "25", "--dtype", "fp32",
                "--actor_zero_stage", "3", "--actor_learning_rate", "1e-2", "--progress_bar", "false", "--save_interval", "0"]

    ref = tmp_path / "uninterrupted"
    run_program("step3_ppo/main.py", args(ref), nprocs=2)
    out = tmp_path / "preempted"
    state = preempt_mid_run("step3_ppo/main.py", args(out), out)
    resumed = run_program("step3_ppo/main.py", [*args(out), "--resume", "auto"], nprocs=2)
    assert f"continuing from {state}" in resumed.stdout
    assert identical(ref / "actor", out / "actor") and not identical(tiny_dir, out / "actor")
