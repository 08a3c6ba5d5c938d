"""Every algorithm of step 3 learns: on a tiny model that answers "yes" or "no" at random, a rule reward
(the fraction of "yes" words, tests/learning/yes_reward.py) rises past a threshold within a few steps,
through the real program. A control run with learning rate 0 stays under the same threshold, so passing
it takes learning, not luck. Runs are fp32 on the CPU with fixed seeds: the same figures every time.

The starting model (yes_no_model) is the tiny random Llama of conftest, fine-tuned here in plain torch to
answer every prompt with six words, each "yes" or "no" with probability 1/2: the reward starts near 0.5.
"""

import json
import random

import pytest
import torch

from testutils import REPO, run_program

WORDS = 6
THRESHOLD = 0.7  # mean reward of the last two steps' samples; the starting model is at ~0.5
STEPS = 8
PROMPTS = [{"prompt": f"Is {i} a nice number? Answer yes or no."} for i in range(64)]


@pytest.fixture(scope="session")
def yes_no_model(cache_dir, tiny_dir, tokenizer):
    """tiny_dir after supervised fine-tuning on random yes/no answers (plain torch, seeded, cached)."""
    from transformers import LlamaForCausalLM

    from rlhfkit.data.tokenize import encode_prompt, encode_response

    out = cache_dir / "tiny-yes-no"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    rng = random.Random(0)
    model = LlamaForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        rows, labels = [], []
        for p in rng.sample(PROMPTS, 16):
            prompt = encode_prompt(tokenizer, [{"role": "user", "content": p["prompt"]}])
            response = encode_response(tokenizer, " ".join(rng.choice(("yes", "no")) for _ in range(WORDS)))
            rows.append(prompt + response)
            labels.append([-100] * len(prompt) + response)
        width = max(map(len, rows))
        ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        lab = torch.tensor([x + [-100] * (width - len(x)) for x in labels])
        loss = model(input_ids=ids, attention_mask=(lab != -100) | (ids != tokenizer.pad_token_id), labels=lab).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "final_sft_loss.txt").write_text(f"{loss.item():.4f}\n")
    tmp.rename(out)
    return out


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("learning") / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return path


@pytest.fixture(scope="module")
def critic_dir(tiny_dir, tmp_path_factory, tokenizer):
    """PPO's critic: the tiny model with a zero score head (stage 'reward'), so that as the reward model it
    adds 0 and the rule reward is the whole reward."""
    from rlhfkit.checkpoint import build_manifest, export_model
    from rlhfkit.models import load_model

    model = load_model(str(tiny_dir), "reward", dtype="fp32", pad_token_id=tokenizer.pad_token_id)
    torch.nn.init.zeros_(model.score.weight)
    out = tmp_path_factory.mktemp("critic") / "critic"
    export_model(model, tokenizer, out, build_manifest(stage="reward", config={}, tokenizer=tokenizer))
    return out


def learn(model, prompts, out, algo, *extra, nprocs=0, lr="3e-3", critic=None):
    """Run step 3 and return the mean reward of each step's samples."""
    args = ["--algo", algo, "--actor_model_name_or_path", str(model), "--reward_fn", "yes_reward:reward",
            "--data_path", str(prompts), "--output_dir", str(out), "--data_split", "0,0,1", "--eval_fraction", "0",
            "--max_prompt_seq_len", "48", "--max_answer_seq_len", "12", "--per_device_generation_batch_size",
            "4", "--n_samples_per_prompt", "4", "--per_device_training_batch_size", "16", "--max_steps", str(STEPS),
            "--dtype", "fp32", "--actor_learning_rate", lr, "--critic_learning_rate", "1e-2", "--progress_bar", "false",
            *(["--critic_model_name_or_path", str(critic)] if critic else []), *extra]
    run_program("step3_ppo/main.py", args, nprocs=nprocs, env_extra={"PYTHONPATH": f"{REPO / 'tests' / 'learning'}:{REPO}"})
    rows = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    return [r["reward/score_mean"] for r in rows if "policy/loss" in r]


# (name, --algo, more flags). GSPO differs from GRPO only with 2+ updates a batch: two epochs here.
OBJECTIVES = {"grpo": ("grpo",), "dapo": ("dapo",), "rloo": ("rloo",), "reinforce_pp": ("reinforce_pp",), "ppo": ("ppo",),
              "dr_grpo": ("dr_grpo",), "gspo": ("grpo", "--policy_loss", "gspo", "--ppo_epochs", "2")}


@pytest.mark.parametrize("name", OBJECTIVES)
def test_every_algorithm_raises_the_reward(yes_no_model, prompts, critic_dir, tmp_path, name):
    algo, *extra = OBJECTIVES[name]
    rewards = learn(yes_no_model, prompts, tmp_path / name, algo, *extra, critic=critic_dir if algo == "ppo" else None)
    assert len(rewards) == STEPS
    assert 0.3 < rewards[0] < 0.7, rewards  # the starting model answers yes half the time
    assert sum(rewards[-2:]) / 2 > THRESHOLD, rewards


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "gspo"])
def test_learning_rate_zero_stays_under_the_threshold(yes_no_model, prompts, tmp_path, name):
    algo, *extra = OBJECTIVES[name]
    rewards = learn(yes_no_model, prompts, tmp_path / "lr0", algo, *extra, lr="0")
    assert len(rewards) == STEPS and sum(rewards[-2:]) / 2 < THRESHOLD, rewards


@pytest.mark.distributed
def test_grpo_learns_on_two_ranks_with_zero3(yes_no_model, prompts, tmp_path):
    rewards = learn(yes_no_model, prompts, tmp_path / "zero3", "grpo", "--actor_zero_stage", "3", nprocs=2)
    assert sum(rewards[-2:]) / 2 > THRESHOLD, rewards

