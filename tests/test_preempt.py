"""Preemption through the real programs (steps 1, 2 and 3, and DPO) on 2 ranks, ZeRO-3, fp32: a signal mid-run,
delivered as a scheduler does, either to the whole process group (srun, scancel) or to the launch script's shell
only (sbatch --signal=B:USR1), which passes it to the ranks; every rank ends its step, one training state is saved
and named, the ranks exit 75; a requeued job (SLURM_RESTART_COUNT) resumes by itself, and the run ends
bit-identical to an uninterrupted one. Also the signal names by hand."""

import base64
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rlhfkit.errors import ConfigError
from rlhfkit.preempt import install
from test_dpo import dpo_args
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


def signal_at_step_2(cmd, out, env, to_group, sig=signal.SIGTERM):
    """Start ``cmd`` in its own session; once the logs show step 2, send ``sig`` to the whole process group or to
    ``cmd``'s process only. -> (returncode, stdout, stderr)."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 300
    while train_steps(out) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    if to_group:
        os.killpg(proc.pid, sig)  # the launcher and both ranks, as srun and scancel do
    else:
        os.kill(proc.pid, sig)  # the batch shell only, as sbatch --signal=B:... does
    stdout, stderr = proc.communicate(timeout=180)
    return proc.returncode, stdout, stderr


def the_saved_state(out, sig_name, stdout, stderr):
    """The one training state a preempted run saved (checked complete), after checking what the run printed."""
    from rlhfkit.resume import verify_state

    states = sorted((out / "training_state").iterdir())
    assert len(states) == 1, (stdout[-3000:], stderr[-3000:])
    step = int(states[0].name.split("_")[1])
    assert step >= 2 and train_steps(out) == step
    assert f"preempted by {sig_name} after step {step}: training state saved in {states[0]}" in stdout + stderr, stderr[-3000:]
    assert f"{sig_name} received; saving a training state at the end of this step" in stdout
    assert "Traceback" not in stdout + stderr
    assert verify_state(states[0]) is None  # complete, although the launcher sent a second SIGTERM during the save
    return states[0]


def preempt_mid_run(script, args, out):
    """``script`` on 2 ranks under ``deepspeed``, SIGTERM to its process group at step 2: the state it saved."""
    cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), str(REPO / script), *args]
    rc, stdout, stderr = signal_at_step_2(cmd, out, env_for_ranks(2), to_group=True)
    assert rc != 0
    return the_saved_state(out, "SIGTERM", stdout, stderr)


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
def test_sigterm_to_the_per_node_launcher_alone_saves(tiny_dir, data, tmp_path):  # noqa: F811
    """SIGTERM to DeepSpeed's per-node launch.py only (what a node agent that started it sends): it passes SIGTERM to
    one rank at a time, waiting up to 30 s for each; the ranks still agree to stop and save one complete state."""
    out = tmp_path / "preempted"
    world = base64.urlsafe_b64encode(json.dumps({"localhost": [0, 1]}).encode()).decode()
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(REPO / "step1_sft/main.py"),
           *sft_args(tiny_dir, data, out, "--max_steps", "30", "--save_interval", "0")]
    rc, stdout, stderr = signal_at_step_2(cmd, out, env_for_ranks(2), to_group=False)
    assert rc != 0
    state = the_saved_state(out, "SIGTERM", stdout, stderr)
    assert "preempted by a signal on another rank" in stdout + stderr  # rank 1 stopped by the agreement, not a signal
    assert int(state.name.split("_")[1]) < 30


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


@pytest.mark.distributed
@pytest.mark.parametrize("script", ["step2_reward/main.py", "step2_dpo/main.py"])
def test_step2_and_dpo_preempted_mid_run_resume_exactly(tiny_dir, data, tmp_path, script):  # noqa: F811
    def args(out):
        return dpo_args(tiny_dir, data, out, "--zero_stage", "3", "--max_steps", "20", "--save_interval", "0",
                        "--eval_fraction", "0")

    ref = tmp_path / "uninterrupted"
    run_program(script, args(ref), nprocs=2)
    out = tmp_path / "preempted"
    state = preempt_mid_run(script, args(out), out)
    resumed = run_program(script, [*args(out), "--resume", "auto"], nprocs=2)
    assert f"continuing from {state}" in resumed.stdout
    assert identical(ref, out) and not identical(tiny_dir, out)


def launch_script_env(tmp_path, **extra):
    env = env_for_ranks(2)
    env.update(RLHFKIT_NO_SETUP="1", VENV=str(VENV_BIN.parent), TMPDIR=str(tmp_path), NUM_RANKS="2",
               MASTER_PORT=str(free_port()), **extra)
    return env


@pytest.mark.distributed
def test_sigusr1_to_the_launch_script_alone_reaches_the_ranks(tiny_dir, data, tmp_path):  # noqa: F811
    """sbatch --signal=B:USR1 signals only the batch shell; DeepSpeed's launcher would not pass SIGUSR1 on.
    launch/step1_sft.sh passes it to the ranks, waits for their save and exits 75; the requeued script resumes."""
    def cmd(out):
        return ["bash", str(REPO / "launch" / "step1_sft.sh"), "--model", str(tiny_dir), "--data", str(data),
                "--output", str(out), *sft_args(tiny_dir, data, out, "--max_steps", "30", "--save_interval", "0")[6:]]

    ref = tmp_path / "uninterrupted"
    done = subprocess.run(cmd(ref), cwd=REPO, env=launch_script_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "preempted"
    rc, stdout, stderr = signal_at_step_2(cmd(out), out, launch_script_env(tmp_path), to_group=False, sig=signal.SIGUSR1)
    assert rc == 75, (stdout[-3000:], stderr[-3000:])
    assert "[launch] SIGUSR1 received: passing it to the ranks (pids " in stdout
    assert "[launch] preempted: the training state is saved" in stdout
    state = the_saved_state(out, "SIGUSR1", stdout, stderr)
    assert int(state.name.split("_")[1]) < 30
    assert f"preempted by SIGUSR1 after step {state.name.split('_')[1]}" in (out / "logs" / "train.log").read_text()
    resumed = subprocess.run(cmd(out), cwd=REPO, env=launch_script_env(tmp_path, SLURM_RESTART_COUNT="1"),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"continuing from {state}" in resumed.stdout and identical(ref, out)
