"""Step 3 through the real program on tiny models: one PPO step on 1 rank ZeRO-0 and 2 ranks ZeRO-3,
the GRPO family without a critic, and DeepSpeed-Chat's known failure modes."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from testutils import run_program

PROMPTS = [{"prompt": f"Tell me something about number {i}.", "chosen": f"Number {i} is nice.",
            "rejected": f"I refuse {i}."} for i in range(12)]
MATH = [{"question": f"What is {i} plus {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(12)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("step3data")
    (d / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    (d / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MATH))
    return d


def ppo_args(actor, critic, data, out, *extra):
    return ["--actor_model_name_or_path", str(actor), "--critic_model_name_or_path", str(critic), "--data_path", str(data),
            "--output_dir", str(out), "--data_split", "0,0,1", "--eval_fraction", "0.2", "--max_eval_samples", "2",
            "--max_prompt_seq_len", "48", "--max_answer_seq_len", "8", "--per_device_generation_batch_size", "2",
            "--per_device_training_batch_size", "2", "--max_steps", "1", "--dtype", "fp32", "--actor_learning_rate", "1e-2",
            "--critic_learning_rate", "1e-2", "--progress_bar", "false", *extra]


def read_metrics(out):
    return [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]


def assert_finite(step, keys):
    """Every key is in the metrics row and its value is a finite number."""
    missing = [k for k in keys if k not in step]
    assert not missing, (missing, step)
    bad = {k: step[k] for k in keys if not math.isfinite(step[k])}
    assert not bad, (bad, step)


def weights_changed(before_dir, after_dir):
    a, b = load_file(before_dir / "model.safetensors"), load_file(after_dir / "model.safetensors")
    return any(not torch.equal(a[k].float(), b[k].float()) for k in a if k in b)


@pytest.mark.parametrize("ranks,zero", [(1, 0), pytest.param(2, 3, marks=pytest.mark.distributed)])
def test_ppo_step(tiny_dir, reward_dir, data, tmp_path, ranks, zero):
    out = tmp_path / "ppo"
    proc = run_program("step3_ppo/main.py", ppo_args(tiny_dir, reward_dir, data / "pairs.jsonl", out, "--actor_zero_stage",
                                                     str(zero), "--critic_zero_stage", str(zero), "--enable_ema",
                                                     "--judge", str(reward_dir),  # the reward model again: same scores
                                                     # ZeRO-3: the offloaded reference keeps the engine path, the rest use copies
                                                     *(["--offload_reference_model"] if zero == 3 else [])), nprocs=ranks)
    step = [r for r in read_metrics(out) if "policy/loss" in r][0]
    assert_finite(step, ("policy/loss", "value/loss", "value/explained_var", "kl/per_token", "reward/score_mean",
                         "policy/entropy", "policy/clip_frac",
                         "time/generation_s", "gen/truncated_rate", "perf/gen_tokens_per_s"))
    assert weights_changed(tiny_dir, out / "actor")  # the actor trained
    assert weights_changed(reward_dir, out / "critic")  # the critic trained
    manifest = json.loads((out / "actor" / "rlhfkit.json").read_text())
    assert manifest["stage"] == "actor" and json.loads((out / "critic" / "rlhfkit.json").read_text())["stage"] == "critic"
    fp = manifest["metrics"]["frozen_fingerprints"]  # the program checks these did not move; they are recorded
    assert set(fp) == {"reference", "reward_model", "judge"}
    assert (out / "actor_ema" / "rlhfkit.json").exists()
    assert "held-out reward" in proc.stdout
    # the gain is paired by prompt over every rank's prompts: its mean is the difference of the two means
    m = manifest["metrics"]
    evals = [r for r in read_metrics(out) if "eval/reward" in r]
    assert m["eval_reward_gain"] == pytest.approx(evals[-1]["eval/reward"] - evals[0]["eval/reward"], abs=1e-9)
    assert m["eval_prompts"] == evals[-1]["eval/prompts"] == 2
    assert m["eval_reward_gain_ci"][0] <= m["eval_reward_gain"] <= m["eval_reward_gain_ci"][1]
    assert "held-out gain" in proc.stdout and "paired over 2 prompts" in proc.stdout
    # --judge scores the same held-out responses as the training reward model (here the same model: the same
    # scores), reported on its own, with its paired change; it never enters the training reward
    assert [r["eval/judge"] for r in evals] == pytest.approx([r["eval/reward"] for r in evals], abs=1e-5)
    assert m["eval_judge_change"] == pytest.approx(m["eval_reward_gain"], abs=1e-5)
    assert "reward/judge" not in step and "held-out judge" in proc.stdout


def test_held_out_eval_samples_and_leaves_training_as_it_was(tiny_dir, reward_dir, data, tmp_path):
    """The held-out evaluation samples 4 responses per prompt at temperature 1 and estimates the KL to the
    reference (k3, never negative): 0 at step 0, where the actor is the reference, and > 0 once it trained.
    Its sampling runs in a random state of its own, so the trained actor is bit for bit the one a run
    with greedy evaluation (which draws nothing) trains."""
    runs = {}
    for name, extra in (("sampled", []), ("greedy", ["--eval_greedy"])):
        out = tmp_path / name
        run_program("step3_ppo/main.py", ppo_args(tiny_dir, reward_dir, data / "pairs.jsonl", out, "--temperature", "1.5", *extra),
                    nprocs=0)
        runs[name] = [r for r in read_metrics(out) if "eval/reward" in r]
    sampled, greedy = runs["sampled"], runs["greedy"]
    assert [r["step"] for r in sampled] == [0, 1] and sampled[0]["eval/prompts"] == 2
    assert sampled[0]["eval/samples"] == 8 and greedy[0]["eval/samples"] == 2
    keys = ("eval/reward", "eval/reward_se", "eval/kl_per_token", "eval/kl_per_seq", "eval/kl_k1_per_token", "eval/kl_k1_per_seq")
    for row in sampled + greedy:
        assert_finite(row, keys)
        assert row["eval/kl_per_token"] >= 0 and row["eval/kl_per_seq"] >= 0
    assert sampled[0]["eval/kl_per_token"] == 0.0 and sampled[0]["eval/kl_k1_per_seq"] == 0.0  # the actor is the reference
    assert sampled[1]["eval/kl_per_token"] > 0
    a = load_file(tmp_path / "sampled" / "actor" / "model.safetensors")
    b = load_file(tmp_path / "greedy" / "actor" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert weights_changed(tiny_dir, tmp_path / "sampled" / "actor")


@pytest.mark.distributed
@pytest.mark.parametrize("algo", ["grpo", "dapo", "rloo", "reinforce_pp"])
def test_critic_free_algorithms(tiny_dir, reward_dir, data, tmp_path, algo):
    """Each critic-free algorithm trains one step on 2 ranks, ZeRO-3, and the actor moves. The reward is
    the gsm8k rule plus the tiny reward model: the random actor never earns the rule's reward, and the
    model's varied scores give the step non-zero advantages to learn from."""
    out = tmp_path / algo
    args = ["--algo", algo, "--actor_model_name_or_path", str(tiny_dir), "--reward_fn", "gsm8k",
            "--reward_model_name_or_path", str(reward_dir), "--data_path",
            str(data / "math.jsonl"), "--output_dir", str(out), "--data_split", "0,0,1", "--eval_fraction", "0.2",
            "--max_eval_samples", "2", "--max_prompt_seq_len", "48", "--max_answer_seq_len", "6",
            "--per_device_generation_batch_size", "1", "--per_device_training_batch_size", "2", "--n_samples_per_prompt",
            "2" if algo != "reinforce_pp" else "1", "--max_steps", "1", "--dtype", "fp32", "--actor_zero_stage", "3",
            "--progress_bar", "false"]
    if algo == "reinforce_pp":  # one sample per prompt: the rewards themselves, whitened over the batch, are the signal
        args[args.index("--per_device_training_batch_size") + 1] = "1"
        args += ["--clip_reward_value", "100"]  # the random score head's scores (around -10 to -20) would all clip to -5
    if algo == "dapo":  # the other attention kernel that takes packed groups' 4D masks (the default is sdpa)
        args += ["--attn_implementation", "eager"]
    if algo == "rloo":  # KL in the reward: the actor's experience pass and two updates, all on packed groups
        args += ["--ppo_epochs", "2"]
    proc = run_program("step3_ppo/main.py", args, nprocs=2)
    if algo == "rloo":
        assert "2 updates/step, groups packed" in proc.stdout
    rows = read_metrics(out)
    step = [r for r in rows if "policy/loss" in r or "sampling/skipped_step" in r][0]
    assert "sampling/skipped_step" not in step, step  # the step trained
    assert_finite(step, ("policy/loss", "policy/entropy", "policy/clip_frac", "policy/approx_kl", "kl/per_token",
                         "reward/score_mean", "gen/truncated_rate"))
    assert "value/loss" not in step  # no critic
    # the gsm8k reward's parts are reported per step (over every sample generated) and at evaluation
    assert 0.0 <= step["reward/gsm8k_accuracy"] <= 1.0 and 0.0 <= step["reward/gsm8k_format"] <= 1.0
    assert "eval/gsm8k_accuracy" in rows[0] and "eval/gsm8k_format" in rows[0]
    if algo == "grpo":  # each part's held-out change, paired by prompt, in the manifest and the summary
        m = json.loads((out / "actor" / "rlhfkit.json").read_text())["metrics"]
        evals = [r for r in rows if "eval/gsm8k_format" in r]
        for part in ("gsm8k_accuracy", "gsm8k_format"):
            assert (m[f"eval_{part}_before"], m[f"eval_{part}_after"]) == (evals[0][f"eval/{part}"], evals[-1][f"eval/{part}"])
            assert m[f"eval_{part}_change"] == pytest.approx(m[f"eval_{part}_after"] - m[f"eval_{part}_before"], abs=1e-9)
            assert f"held-out {part}" in proc.stdout
    assert (out / "actor" / "rlhfkit.json").exists() and not (out / "critic").exists()  # no critic built
    assert weights_changed(tiny_dir, out / "actor")  # the actor trained


def test_truncated_responses_reach_metrics_and_truncated_reward(tiny_dir, reward_dir, data, tmp_path):
    """DeepSpeed-Chat scores a response cut at max length as if it had ended; here the flag reaches the
    metrics and --truncated_reward replaces its score."""
    out = tmp_path / "trunc"
    run_program("step3_ppo/main.py", ppo_args(tiny_dir, reward_dir, data / "pairs.jsonl", out, "--max_answer_seq_len", "2",
                                              "--truncated_reward", "-7", "--clip_reward_value", "10"), nprocs=0)
    step = [r for r in read_metrics(out) if "policy/loss" in r][0]
    # a random tiny model essentially never emits EOS within 2 tokens
    assert step["gen/truncated_rate"] == pytest.approx(1.0)
    assert step["reward/shaped_mean"] == pytest.approx(-7.0) and step["reward/score_mean"] != pytest.approx(-7.0)


def test_critic_warm_up_freezes_the_actor_for_its_steps(tiny_dir, reward_dir, data, tmp_path):
    """--freezing_actor_steps 2 of 3: steps 1-2 train the critic alone (no policy metrics, the actor's KL to the
    reference exactly 0), step 3 trains both."""
    out = tmp_path / "warm"
    run_program("step3_ppo/main.py", ppo_args(tiny_dir, reward_dir, data / "pairs.jsonl", out, "--max_steps", "3",
                                              "--freezing_actor_steps", "2", "--eval_fraction", "0"), nprocs=0)
    steps = [r for r in read_metrics(out) if "value/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert ["policy/loss" in r for r in steps] == [False, False, True]
    assert steps[0]["kl/per_token"] == 0.0 and steps[1]["kl/per_token"] == 0.0
    assert weights_changed(reward_dir, out / "critic") and weights_changed(tiny_dir, out / "actor")


def test_bad_setups_give_one_message(tiny_dir, reward_dir, data, tmp_path):
    prompts_only = tmp_path / "prompts.jsonl"
    prompts_only.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in PROMPTS))
    cases = [
        (["--unsupervised_dataset_name", str(prompts_only)], "but the PTX loss (step 3's --unsupervised_dataset_name) needs "),
        (["--algo", "grpo"], "set --n_samples_per_prompt >= 2"),
        (["--per_device_training_batch_size", "3"], "must divide the samples per rank"),
        (["--rollout_backend", "deepspeed"], "needs CUDA"),
        (["--actor_zero_stage", "4"], "--actor_zero_stage 4 is out of range"),
        (["--empty_reward", "never"], "--empty_reward never: use min, keep or a number"),
        (["--algo", "grpo", "--n_samples_per_prompt", "2", "--freezing_actor_steps", "2"], "a critic warm-up, for --algo ppo only"),
    ]
    for extra, message in cases:
        proc = run_program("step3_ppo/main.py", ppo_args(tiny_dir, reward_dir, data / "pairs.jsonl", tmp_path / "x", *extra),
                           nprocs=0, check=False)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, (extra, proc.stderr[-2000:])
    # a reward model where the actor belongs
    proc = run_program("step3_ppo/main.py", ppo_args(reward_dir, reward_dir, data / "pairs.jsonl", tmp_path / "y"), nprocs=0, check=False)
    assert proc.returncode == 2 and "is a 'reward' checkpoint, but --actor_model_name_or_path expects" in proc.stderr
    # a reward model trained with another tokenizer
    import shutil

    other = tmp_path / "other_rm"
    shutil.copytree(reward_dir, other)
    m = json.loads((other / "rlhfkit.json").read_text())
    m["tokenizer_sha256"] = "0" * 64
    (other / "rlhfkit.json").write_text(json.dumps(m))
    proc = run_program("step3_ppo/main.py", ppo_args(tiny_dir, other, data / "pairs.jsonl", tmp_path / "z"), nprocs=0, check=False)
    assert proc.returncode == 2 and "tokenizer mismatch" in proc.stderr and "Traceback" not in proc.stderr


REWARD_MODULE = '''
"""Controlled rewards for the dynamic-sampling test: training rounds (one prompt, its G samples)
listed in RK_FLAT_ROUNDS get the same reward for every sample (a uniform group, no signal); the
others get 0, 1, 0, 1, ... (an informative group). Evaluation batches get zeros."""
import os

ROUND = [0]


def reward(prompts, responses, rows):
    if len(prompts) < 2 or len(set(prompts)) != 1:  # evaluation: distinct prompts, one sample each
        return [0.0] * len(prompts)
    ROUND[0] += 1
    flat = {int(x) for x in os.environ["RK_FLAT_ROUNDS"].split(",")}
    return [3.0] * len(prompts) if ROUND[0] in flat else [float(i % 2) for i in range(len(prompts))]
'''


def test_dynamic_sampling_fills_the_batch_then_gives_up_after_max_rounds(tiny_dir, data, tmp_path):
    """DAPO dynamic sampling with controlled rewards. Step 1: round 1 is uniform and dropped, round 2
    fills the batch (2 rounds, trained on a full batch). Step 2: rounds 3-5 are all uniform, so after
    --max_sampling_rounds 3 the step is skipped and reported."""
    (tmp_path / "controlled_reward.py").write_text(REWARD_MODULE)
    out = tmp_path / "dapo"
    args = ["--algo", "dapo", "--dynamic_sampling", "--max_sampling_rounds", "3", "--actor_model_name_or_path", str(tiny_dir),
            "--reward_fn", "controlled_reward:reward", "--data_path", str(data / "math.jsonl"), "--output_dir", str(out),
            "--data_split", "0,0,1", "--eval_fraction", "0.2", "--max_eval_samples", "2", "--max_prompt_seq_len", "48",
            "--max_answer_seq_len", "4", "--per_device_generation_batch_size", "1", "--n_samples_per_prompt", "2",
            "--per_device_training_batch_size", "2", "--max_steps", "2", "--dtype", "fp32", "--progress_bar", "false",
            "--eval_n_samples_per_prompt", "1"]  # the reward module tells evaluation batches by their distinct prompts
    from testutils import REPO

    run_program("step3_ppo/main.py", args, nprocs=0,
                env_extra={"RK_FLAT_ROUNDS": "1,3,4,5", "PYTHONPATH": f"{tmp_path}:{REPO}"})
    steps = {r["step"]: r for r in read_metrics(out) if "sampling/rounds" in r}
    assert steps[1]["sampling/rounds"] == 2 and "policy/loss" in steps[1] and "sampling/skipped_step" not in steps[1]
    assert steps[1]["reward/score_mean"] == pytest.approx(0.5)  # trained on the informative group only: rewards 0 and 1
    assert steps[1]["reward/score_std"] == pytest.approx(2 ** -0.5)
    assert steps[2]["sampling/rounds"] == 3 and steps[2]["sampling/skipped_step"] == 1 and "policy/loss" not in steps[2]


def test_one_update_per_batch_takes_old_logprobs_from_the_training_forward(tiny_dir, data, tmp_path):
    """GRPO with one optimiser update per batch (2 samples, training batch 2, ppo_epochs 1): no actor pass
    in the experience phase; the update's own detached logprobs are the old ones, so the ratio is exactly
    1 (nothing clipped, approx KL 0), and the KL to the reference is still measured (> 0 once the actor
    moved)."""
    (tmp_path / "controlled_reward.py").write_text(REWARD_MODULE)  # rewards 0, 1, 0, 1: every group informative
    out = tmp_path / "grpo"
    args = ["--algo", "grpo", "--actor_model_name_or_path", str(tiny_dir), "--reward_fn", "controlled_reward:reward", "--data_path",
            str(data / "math.jsonl"), "--output_dir", str(out), "--data_split", "0,0,1", "--eval_fraction", "0.2",
            "--max_eval_samples", "2", "--max_prompt_seq_len", "48", "--max_answer_seq_len", "6", "--temperature", "1.5",
            "--per_device_generation_batch_size", "1", "--per_device_training_batch_size", "2", "--n_samples_per_prompt", "2",
            "--max_steps", "3", "--dtype", "fp32", "--actor_learning_rate", "5e-2", "--progress_bar", "false"]
    from testutils import REPO

    proc = run_program("step3_ppo/main.py", args, nprocs=0, env_extra={"RK_FLAT_ROUNDS": "0", "PYTHONPATH": f"{tmp_path}:{REPO}"})
    assert "1 updates/step" in proc.stdout
    steps = [r for r in read_metrics(out) if "policy/loss" in r]
    assert len(steps) == 3
    assert all(r["policy/approx_kl"] == 0.0 and r["policy/clip_frac"] == 0.0 for r in steps), steps
    assert abs(steps[0]["kl/per_token"]) < 1e-6 and steps[-1]["kl/per_token"] > 1e-6, [r["kl/per_token"] for r in steps]


@pytest.mark.parametrize("train_batch,ppo_epochs,packed", [(2, 1, True), (1, 1, False), (2, 2, True)])
def test_kl_to_the_reference_is_exactly_zero_before_the_first_update(base_dir, data, tmp_path, train_batch, ppo_epochs, packed):
    """bf16 SmolLM2 (the tiny model's packed and unpacked rows round the same), GRPO groups of 2: with
    one update per batch (packed groups in the reference pass and the update), with two mini-batches
    of one sample (no packing anywhere) and with two epochs of one mini-batch of a whole group
    (packed in the actor's and the reference's passes and both updates),
    the reference, the sampling policy and the updated policy are scored the same way: at step 1,
    where the policy IS the reference, the KL to it is exactly 0, not rounding noise, and with a
    learning rate of 0 every update's ratio is exactly 1."""
    out = tmp_path / "grpo"
    args = ["--algo", "grpo", "--actor_model_name_or_path", str(base_dir), "--reward_fn", "gsm8k", "--data_path",
            str(data / "math.jsonl"), "--output_dir", str(out), "--data_split", "0,0,1", "--eval_fraction", "0.2",
            "--max_eval_samples", "2", "--max_prompt_seq_len", "48", "--max_answer_seq_len", "8", "--temperature", "1.5",
            "--per_device_generation_batch_size", "1", "--per_device_training_batch_size", str(train_batch),
            "--ppo_epochs", str(ppo_epochs), "--actor_learning_rate", "0", "--n_samples_per_prompt", "2", "--max_steps", "1",
            "--dtype", "bf16", "--progress_bar", "false"]
    proc = run_program("step3_ppo/main.py", args, nprocs=0)
    assert f"{ppo_epochs * 2 // train_batch} updates/step{', groups packed' if packed else ''}, " in proc.stdout
    step = [r for r in read_metrics(out) if "kl/per_token" in r and "policy/loss" in r][0]
    assert step["kl/per_token"] == 0.0 and step["kl/per_seq"] == 0.0, step
    assert step["policy/approx_kl"] == 0.0 and step["policy/clip_frac"] == 0.0, step


def test_compiled_blocks_train_the_actor_and_the_critic_as_eager_blocks_do(tiny_dir, reward_dir, data, tmp_path):
    """--compile_blocks reaches both trained models of step 3; their first update's losses (fp32) equal
    an eager run's up to rounding."""
    steps = {}
    for name, extra in (("eager", ()), ("compiled", ("--compile_blocks", "true"))):
        out = tmp_path / name
        proc = run_program("step3_ppo/main.py", ppo_args(tiny_dir, reward_dir, data / "pairs.jsonl", out, "--eval_fraction", "0",
                                                         *extra), nprocs=0)
        assert proc.stdout.count("--compile_blocks: 2 transformer blocks run a compiled forward") == (2 if extra else 0)
        steps[name] = [r for r in read_metrics(out) if "policy/loss" in r][0]
        assert weights_changed(tiny_dir, out / "actor") and weights_changed(reward_dir, out / "critic")
    for key in ("policy/loss", "value/loss", "policy/entropy", "reward/score_mean"):
        assert steps["compiled"][key] == pytest.approx(steps["eager"][key], rel=1e-4, abs=1e-6), key


def test_ptx_loss_joins_the_actor_update(tiny_dir, reward_dir, data, tmp_path):
    """--unsupervised_dataset_name: an SFT batch's loss joins each actor update (InstructGPT's PPO-ptx), logged."""
    out = tmp_path / "ptx"
    run_program("step3_ppo/main.py", ppo_args(tiny_dir, reward_dir, data / "pairs.jsonl", out, "--unsupervised_dataset_name",
                                              str(data / "pairs.jsonl"), "--unsup_coef", "0.5"), nprocs=0)
    steps = [r for r in read_metrics(out) if "policy/loss" in r]
    assert steps and all(math.isfinite(r["policy/ptx_loss"]) and r["policy/ptx_loss"] > 0 for r in steps), steps


def test_ptx_term_lowers_the_ptx_loss(tiny_dir, reward_dir, data, tmp_path):
    """The PTX term's gradient points the right way: with it the actor's SFT loss on the PTX data falls over
    a few steps; with --unsup_coef 0 (the same batches, the term weighted out) it does not fall as far."""
    drop = {}
    for coef in ("1.0", "0.0"):
        out = tmp_path / f"ptx_{coef}"
        run_program("step3_ppo/main.py", ppo_args(tiny_dir, reward_dir, data / "pairs.jsonl", out, "--eval_fraction", "0",
                                                  "--max_steps", "4",
                                                  "--unsupervised_dataset_name", str(data / "pairs.jsonl"),
                                                  "--unsup_coef", coef), nprocs=0)
        losses = [r["policy/ptx_loss"] for r in read_metrics(out) if "policy/ptx_loss" in r]
        assert len(losses) == 4, losses
        drop[coef] = losses[0] - losses[-1]
    assert drop["1.0"] > 1.0 and drop["1.0"] > 3 * max(drop["0.0"], 0.1), drop


@pytest.mark.distributed
def test_ptx_under_zero3_matches_zero2(tiny_dir, reward_dir, data, tmp_path):
    """PTX with a ZeRO-3 actor (two backwards into one step) takes ZeRO-2's steps (one backward of the summed
    loss): the same samples, so the same updates up to the reductions' rounding, and far from the updates
    without the PTX term. The first actor update is made non-finite and skipped: the gradients of its first
    backward must not reach the second step."""
    actors = {}
    for name, zero, ptx in (("z2", "2", True), ("z3", "3", True), ("z3_no_ptx", "3", False)):
        extra = ["--unsupervised_dataset_name", str(data / "pairs.jsonl")] if ptx else []
        out = tmp_path / name
        run_program("step3_ppo/main.py", ppo_args(tiny_dir, reward_dir, data / "pairs.jsonl", out, "--actor_zero_stage", zero,
                                                  "--critic_zero_stage", zero, "--actor_learning_rate", "1e-3",
                                                  "--eval_fraction", "0", "--max_steps", "2", *extra), nprocs=2,
                    env_extra={"RLHFKIT_FAULT_NAN_AT": "1"})  # the guard's first loss: step 1's actor update
        actors[name] = load_file(out / "actor" / "model.safetensors")
        steps = [r for r in read_metrics(out) if "policy/loss" in r]
        assert len(steps) == 2 and all(("policy/ptx_loss" in r) == ptx for r in steps), steps
        assert [r["nonfinite/skipped"] for r in steps] == [1, 1], steps
    start = load_file(tiny_dir / "model.safetensors")
    assert relative_gap(actors["z3"], actors["z2"], start) < 2e-4  # a planted bug gave 0.007 and 0.016
    assert relative_gap(actors["z3_no_ptx"], actors["z2"], start) > 0.3


def relative_gap(a: dict, b: dict, start: dict) -> float:
    """The summed |a - b| over the weights, relative to how far the training moved ``b`` from ``start``."""
    return sum((a[k].float() - b[k].float()).abs().sum().item() for k in start) / \
        sum((b[k].float() - start[k].float()).abs().sum().item() for k in start)
