"""Reliability through the real programs: exact resume after SIGKILL (a training step of step 1, a
generation of step 3), a dead rank ends the job, corrupted states, NaN losses, bad inputs.

What "identical" means here: every tensor of the exported model.safetensors (actor, critic and the
actor EMA for step 3) is bit-for-bit equal to the uninterrupted run's, fp32 on CPU, same seed, same
world size (2 ranks, ZeRO-3)."""

import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file

from testutils import run_program

PAIRS = [{"prompt": f"Question {i}?", "chosen": f"A fine answer number {i}.", "rejected": f"No {i}."} for i in range(24)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    p = tmp_path_factory.mktemp("rel") / "pairs.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    return p


def identical(a_dir, b_dir):
    a, b = load_file(a_dir / "model.safetensors"), load_file(b_dir / "model.safetensors")
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def sft_args(model, data, out, *extra):
    return ["--model_name_or_path", str(model), "--data_path", str(data), "--output_dir", str(out), "--data_split", "1,0,0",
            "--max_seq_len", "48", "--dtype", "fp32", "--zero_stage", "3", "--learning_rate", "3e-3", "--per_device_train_batch_size",
            "2", "--max_steps", "5", "--save_interval", "2", "--lr_scheduler_type", "constant", "--max_eval_samples", "2",
            "--progress_bar", "false", *extra]


@pytest.mark.distributed
def test_sft_killed_mid_step_resumes_exactly_and_dead_rank_ends_job(tiny_dir, data, tmp_path):
    ref = tmp_path / "uninterrupted"
    run_program("step1_sft/main.py", sft_args(tiny_dir, data, ref), nprocs=2)
    out = tmp_path / "killed"
    t = time.time()
    proc = run_program("step1_sft/main.py", sft_args(tiny_dir, data, out), nprocs=2, check=False,
                       env_extra={"RLHFKIT_FAULT_KILL": "train_step:4"}, launcher=True)
    # rank 0 died (SIGKILL) inside its 4th training step: the job ends, non-zero, promptly, and the
    # surviving rank says in its own line why it stops (run_main), not with a stack
    assert proc.returncode != 0 and time.time() - t < 300
    assert "SIGKILL at train_step #4" in proc.stdout
    assert "error: rank 1 of 2: a collective operation failed, so another rank died" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert [p.name for p in (out / "training_state").iterdir()] == ["step_2"]
    proc = run_program("step1_sft/main.py", sft_args(tiny_dir, data, out, "--resume", "auto"), nprocs=2)
    assert "continuing from" in proc.stdout and identical(ref, out)


def test_sft_clean_stop_then_resume_matches(tiny_dir, data, tmp_path):
    """A run that ends after its --save_interval (max_steps 2), continued to 5, equals a 5-step run.
    One rank, ZeRO-0: the stop and the resume are the point (the test above resumes 2 ranks)."""
    ref = tmp_path / "five"
    run_program("step1_sft/main.py", sft_args(tiny_dir, data, ref, "--zero_stage", "0"), nprocs=1)
    out = tmp_path / "two_then_five"
    run_program("step1_sft/main.py", sft_args(tiny_dir, data, out, "--zero_stage", "0", "--max_steps", "2"), nprocs=1)
    run_program("step1_sft/main.py", sft_args(tiny_dir, data, out, "--zero_stage", "0", "--resume", "auto"), nprocs=1)
    assert identical(ref, out)
    # a changed setting that matters is refused, with the field named
    proc = run_program("step1_sft/main.py", sft_args(tiny_dir, data, out, "--zero_stage", "0", "--resume", "auto",
                                                      "--learning_rate", "1e-2"), nprocs=0, check=False)
    assert proc.returncode == 2 and "--learning_rate 0.003 -> 0.01" in proc.stderr and "--resume_allow_config_change" in proc.stderr


def test_corrupted_state_skipped_by_auto_refused_by_name(tiny_dir, data, tmp_path):
    out = tmp_path / "c"
    run_program("step1_sft/main.py", sft_args(tiny_dir, data, out, "--zero_stage", "0", "--max_steps", "4"), nprocs=0)
    states = sorted((out / "training_state").iterdir())
    assert [p.name for p in states] == ["step_2", "step_4"]
    victim = next(p for p in (states[1]).rglob("*") if p.is_file() and p.stat().st_size > 1000)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # truncated
    proc = run_program("step1_sft/main.py", sft_args(tiny_dir, data, out, "--zero_stage", "0", "--max_steps", "4", "--resume", "auto"),
                       nprocs=0)
    assert f"skipping {states[1]}" in proc.stdout and "continuing from" in proc.stdout and "step_2" in proc.stdout
    # the auto resume above re-saved step_4 (complete again); corrupt it again and name it
    victim = next(p for p in states[1].rglob("*") if p.is_file() and p.stat().st_size > 1000)
    victim.write_bytes(victim.read_bytes()[:10])
    proc = run_program("step1_sft/main.py", sft_args(tiny_dir, data, out, "--zero_stage", "0", "--resume", str(states[1])),
                       nprocs=0, check=False)
    assert proc.returncode == 2 and "incomplete or corrupted" in proc.stderr and "Traceback" not in proc.stderr


def test_nan_losses_skipped_then_stop_with_last_state_intact(tiny_dir, data, tmp_path):
    out = tmp_path / "nan"
    proc = run_program("step1_sft/main.py", sft_args(tiny_dir, data, out, "--zero_stage", "0", "--max_steps", "4"), nprocs=0,
                       env_extra={"RLHFKIT_FAULT_NAN_AT": "2"})
    rows = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines() if "train/nonfinite_skipped" in x]
    assert rows[-1]["train/nonfinite_skipped"] == 1 and rows[-1]["step"] == 4  # skipped, counted, the run went on
    out2 = tmp_path / "nan_stop"
    proc = run_program("step1_sft/main.py", sft_args(tiny_dir, data, out2, "--zero_stage", "0", "--max_steps", "6",
                                                      "--max_nonfinite_steps", "3"), nprocs=0, check=False,
                       env_extra={"RLHFKIT_FAULT_NAN_AT": "5,6,7"})
    assert proc.returncode == 2 and "3 consecutive non-finite losses" in proc.stderr and "Traceback" not in proc.stderr
    state = out2 / "training_state" / "step_4"
    assert f"Last good training state: {state}" in proc.stderr
    from rlhfkit.resume import verify_state

    assert verify_state(state) is None  # the last good state is complete and loadable
    proc = run_program("step1_sft/main.py", sft_args(tiny_dir, data, out2, "--zero_stage", "0", "--max_steps", "6", "--resume", "auto"),
                       nprocs=0)
    assert (out2 / "rlhfkit.json").exists()


@pytest.mark.distributed
def test_ppo_killed_during_generation_resumes_exactly(tiny_dir, tmp_path, tokenizer):
    from rlhfkit.checkpoint import build_manifest, export_model
    from rlhfkit.models import load_model

    torch.manual_seed(3)
    rm = load_model(str(tiny_dir), "reward", dtype="fp32", pad_token_id=tokenizer.pad_token_id)
    rm.score.weight.data.normal_(0, 1.0)
    rm_dir = tmp_path / "rm"
    export_model(rm, tokenizer, rm_dir, build_manifest(stage="reward", config={}, tokenizer=tokenizer))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say something about {i}."}) + "\n" for i in range(16)))
    args = ["--actor_model_name_or_path", str(tiny_dir), "--critic_model_name_or_path", str(rm_dir), "--data_path", str(prompts),
            "--data_split", "0,0,1", "--max_steps", "4", "--dtype", "fp32", "--actor_zero_stage", "3", "--critic_zero_stage", "3",
            "--max_prompt_seq_len", "64", "--max_answer_seq_len", "6", "--per_device_generation_batch_size", "2",
            "--per_device_training_batch_size", "2", "--max_eval_samples", "2", "--progress_bar", "false", "--save_interval", "2",
            "--enable_ema", "--actor_learning_rate", "1e-3", "--normalize_reward"]  # its running moments are in the state
    ref = tmp_path / "ppo_ref"
    run_program("step3_ppo/main.py", args + ["--output_dir", str(ref)], nprocs=2)
    out = tmp_path / "ppo_killed"
    proc = run_program("step3_ppo/main.py", args + ["--output_dir", str(out)], nprocs=2, check=False,
                       env_extra={"RLHFKIT_FAULT_KILL": "generation:3"})
    assert proc.returncode != 0 and "SIGKILL at generation #3" in proc.stdout
    run_program("step3_ppo/main.py", args + ["--output_dir", str(out), "--resume", "auto"], nprocs=2)
    for sub in ("actor", "critic", "actor_ema"):
        assert identical(ref / sub, out / sub), sub
