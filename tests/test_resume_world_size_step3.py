"""Step 3 resumed on another number of ranks (--resume_allow_world_size_change; rlhfkit.ppo.reshard), fp32 on CPU:
PPO with a critic under ZeRO-3 saved on 1 rank, resumed on 2 (greedy rollouts, so the runs can be compared tightly);
GRPO under ZeRO-2 saved on 2 ranks, resumed on 1 (sampled groups of 2).

Bit-identity with the uninterrupted run is impossible (other samples, other reduction order), so what is checked is:
the weights right after loading (actor, critic, the actor's EMA) equal the saved ones exactly; the resumed run trains,
step by step, on exactly the prompts the uninterrupted run trained on from there (read from a reward function that logs
its prompts), each prompt's samples on one rank; the extra state (KL controller, running reward moments, reward-function
normalisers, prompt position) carries on; the reward and the losses continue within noise. Also the refusals, word for
word, and the per-rank batch choices and EMA re-partitioning without processes."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit import distributed as dist
from rlhfkit.errors import CheckpointError, ConfigError
from rlhfkit.ppo.reshard import PPOLayout, recut, reshard_batches, resharded_ema, resume_layout
from rlhfkit.resume import STATE_FILE
from testutils import REPO, run_program

PROMPTS = [{"prompt": f"Say something about {i}."} for i in range(10, 22)]  # 12 prompts: 6 steps of 2 per epoch

# A reward function that logs, per rank, the prompts of each call (one call per step: one generation batch, no
# held-out evaluation) and scores a response by its length.
PROMPT_LOG = '''
import json, os, re


def reward(prompts, responses, rows):
    asked = [re.search(r"Say something about \\d+", p).group(0) for p in prompts]
    with open(os.path.join(os.environ["RK_PROMPT_LOG"], f"rank{os.environ.get('RANK', '0')}.jsonl"), "a") as f:
        f.write(json.dumps(asked) + "\\n")
    return [len(r) / 10 for r in responses]
'''

REFUSED = ("error: --resume {state}: the run was saved with 2 ranks and this one has 1. A training state resumes on the "
           "same number of ranks unless --resume_allow_world_size_change is passed (--resume_allow_config_change does "
           "not cover it); then the ZeRO state is re-partitioned, the prompts per step and the samples per update over "
           "all ranks are kept by changing --per_device_generation_batch_size and --per_device_training_batch_size, and "
           "the run is no longer bit-identical to an uninterrupted one. Pass --resume_allow_world_size_change, or start 2 "
           "ranks (--num_gpus / --num_nodes).")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    d = tmp_path_factory.mktemp("ws3")
    (d / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    (d / "promptlog.py").write_text(PROMPT_LOG)
    return d


def run(data, args, out, nprocs, check=True):
    """Step 3 into ``out``, its reward function (in ``data``) logging prompts into ``out``/prompts."""
    (out / "prompts").mkdir(parents=True, exist_ok=True)
    return run_program("step3_ppo/main.py", [*args, "--output_dir", str(out)], nprocs=nprocs, check=check,
                       env_extra={"RK_PROMPT_LOG": str(out / "prompts"), "PYTHONPATH": f"{data}:{REPO}"})


def common(data, *extra):
    """8 steps of 2 prompts (steps 7-8 in the second epoch), a state every 2 steps, all kept."""
    return ["--reward_fn", "promptlog:reward", "--data_path", str(data / "prompts.jsonl"), "--data_split", "0,0,1",
            "--eval_fraction", "0", "--max_prompt_seq_len", "64", "--max_answer_seq_len", "6", "--max_steps", "8",
            "--num_train_epochs", "2", "--save_interval", "2", "--keep_last_k", "0", "--dtype", "fp32",
            "--actor_learning_rate", "1e-3", "--enable_ema", "--progress_bar", "false", *extra]


def trained_prompts(out, group, first_step):
    """{step: sorted prompts over all ranks} from the logging reward; each prompt's ``group`` samples on one rank."""
    steps = {}
    for f in sorted((out / "prompts").glob("rank*.jsonl")):
        for i, line in enumerate(f.read_text().splitlines()):
            mine = json.loads(line)
            assert all(mine.count(p) == group for p in mine), (f.name, first_step + i, mine)
            steps.setdefault(first_step + i, []).extend(sorted(set(mine)))
    for step, seen in steps.items():
        assert len(seen) == len(set(seen)), (step, seen)  # no prompt on two ranks
    return {step: sorted(seen) for step, seen in steps.items()}


def same_prompts(ref, out, group):
    """``out`` (resumed after step 2) trains steps 3-8 on the prompts ``ref`` did; ``ref``'s first epoch (steps 1-6)
    takes every prompt once."""
    a, b = trained_prompts(ref, group, 1), trained_prompts(out, group, 3)
    assert sorted(b) == list(range(3, 9)) and b == {s: a[s] for s in range(3, 9)}, (a, b)
    epoch = [p for s in range(1, 7) for p in a[s]]
    assert len(epoch) == len(set(epoch)) == len(PROMPTS)


def metrics(out):
    rows = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "policy/loss" in r}


def state(out, step):
    return json.loads((out / "training_state" / f"step_{step}" / STATE_FILE).read_text())


def zero_weights(state_dir, name):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(state_dir / name), tag="ds")


def assert_loaded(state_dir, loaded, engines, saved_world):
    """The models ``loaded`` exported right after resuming ``state_dir`` are the saved ones, bit for bit; so is the
    actor's EMA (joined from the saved ranks' shards, in the actor's parameter order)."""
    from transformers import AutoModelForCausalLM

    for name in engines:
        exported, saved = load_file(loaded / name / "model.safetensors"), zero_weights(state_dir, name)
        assert exported and all(torch.equal(exported[k], saved[k]) for k in exported), name
    shards = [torch.load(state_dir / f"extra_rank{r}.pt", weights_only=True)["ema"]["shadow"] for r in range(saved_world)]
    ema = load_file(loaded / "actor_ema" / "model.safetensors")
    names = [(n, p) for n, p in AutoModelForCausalLM.from_pretrained(loaded / "actor").named_parameters()]
    assert len(names) == len(shards[0])
    for i, (n, p) in enumerate(names):
        whole = shards[0][i] if shards[0][i].shape == p.shape else torch.cat([s[i].reshape(-1) for s in shards])[:p.numel()]
        assert torch.equal(ema[n].reshape(-1), whole.reshape(-1)), n


@pytest.mark.distributed
def test_ppo_zero3_saved_on_one_rank_resumes_on_two(tiny_dir, reward_dir, prompts, tmp_path):
    args = ["--actor_model_name_or_path", str(tiny_dir), "--critic_model_name_or_path", str(reward_dir),
            "--critic_learning_rate", "1e-3", "--actor_zero_stage", "3", "--critic_zero_stage", "3", "--greedy_rollouts",
            "--per_device_generation_batch_size", "2", "--per_device_training_batch_size", "2", "--normalize_reward",
            "--target_kl", "0.01", "--kl_horizon", "100", *common(prompts)]
    ref = tmp_path / "ref"
    run(prompts, args, ref, nprocs=0)
    saved = ref / "training_state" / "step_2"
    loaded = tmp_path / "loaded"  # resumed with nothing left to train: it exports what it loaded
    proc = run(prompts, [*args, "--resume", str(saved), "--max_steps", "2", "--resume_allow_world_size_change"], loaded,
               nprocs=2)
    assert ("[resume] 1 -> 2 ranks: 2 prompts per generation batch and 2 samples per update are kept as "
            "--per_device_generation_batch_size 1 --per_device_training_batch_size 1 (saved: 2 and 2 per rank); continuing "
            "at prompt batch 2 of epoch 0; rank r takes the RNG streams of saved rank r % 1") in proc.stdout
    assert_loaded(saved, loaded, ("actor", "critic"), 1)
    out = tmp_path / "resumed"
    run(prompts, [*args, "--resume", str(saved), "--resume_allow_world_size_change"], out, nprocs=2)
    same_prompts(ref, out, 1)
    a, b = metrics(ref), metrics(out)
    for step in range(3, 9):  # greedy: the same responses, so the same rewards and losses up to float noise
        assert b[step]["gen/response_len"] == a[step]["gen/response_len"], step
        for key in ("reward/score_mean", "reward/shaped_mean", "policy/loss", "value/loss", "kl/coef"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-3, abs=1e-5), (step, key, a[step], b[step])
    # the KL controller, the running reward moments and the counters went on from the saved ones
    sa, sb = state(ref, 8), state(out, 8)
    assert sb["world_size"] == 2 and sb["layout"] == {"generation_batch": 1, "training_batch": 1}
    assert sb["counters"]["prompts"] == sa["counters"]["prompts"] == {"epoch": 1, "index": 2}
    assert sb["counters"]["samples"] == sa["counters"]["samples"] == 16
    assert sb["extra"]["reward_norm"]["count"] == sa["extra"]["reward_norm"]["count"] == 16
    assert sb["extra"]["reward_norm"]["mean"] == pytest.approx(sa["extra"]["reward_norm"]["mean"], rel=1e-4)
    assert sb["extra"]["kl_ctl"]["value"] == pytest.approx(sa["extra"]["kl_ctl"]["value"], rel=1e-6)
    assert sa["extra"]["kl_ctl"]["value"] != pytest.approx(0.1, rel=1e-3)  # the controller did move


@pytest.mark.distributed
def test_grpo_zero2_saved_on_two_ranks_resumes_on_one(tiny_dir, prompts, tmp_path):
    args = ["--algo", "grpo", "--actor_model_name_or_path", str(tiny_dir), "--actor_zero_stage", "2", "--n_samples_per_prompt",
            "2", "--per_device_generation_batch_size", "1", "--per_device_training_batch_size", "2", "--normalize_reward_fns",
            *common(prompts)]
    ref = tmp_path / "ref"
    run(prompts, args, ref, nprocs=2)
    saved = ref / "training_state" / "step_2"
    for extra in ([], ["--resume_allow_config_change"]):  # refused without the flag; the config flag does not waive it
        proc = run(prompts, [*args, "--resume", str(saved), *extra], tmp_path / "no", nprocs=0, check=False)
        assert proc.returncode == 2 and REFUSED.format(state=saved) in proc.stderr, proc.stderr[-2000:]
    loaded = tmp_path / "loaded"
    proc = run(prompts, [*args, "--resume", str(saved), "--max_steps", "2", "--resume_allow_world_size_change"], loaded,
               nprocs=0)
    assert ("[resume] 2 -> 1 ranks: 2 prompts per generation batch and 4 samples per update are kept as "
            "--per_device_generation_batch_size 2 --per_device_training_batch_size 4 (saved: 1 and 2 per rank); continuing "
            "at prompt batch 2 of epoch 0; rank r takes the RNG streams of saved rank r % 2") in proc.stdout
    assert "1 updates/step, groups packed" in proc.stdout  # as on 2 ranks: one update of whole groups
    assert_loaded(saved, loaded, ("actor",), 2)
    out = tmp_path / "resumed"
    run(prompts, [*args, "--resume", str(saved), "--resume_allow_world_size_change"], out, nprocs=0)
    same_prompts(ref, out, 2)
    a, b = metrics(ref), metrics(out)
    key = next(k for k in a[3] if k.startswith("reward/fn/") and not k.endswith("/weighted"))
    ra, rb = [a[s][key] for s in range(3, 9)], [b[s][key] for s in range(3, 9)]  # other samples: compared within noise
    se = math.sqrt(torch.tensor(ra).var().item() / 6 + torch.tensor(rb).var().item() / 6)
    assert abs(sum(ra) / 6 - sum(rb) / 6) <= 4 * se + 1e-6, (ra, rb)
    assert all(math.isfinite(b[s]["policy/loss"]) for s in range(3, 9))
    sa, sb = state(ref, 8), state(out, 8)
    assert sb["counters"]["prompts"] == sa["counters"]["prompts"] and sb["counters"]["samples"] == sa["counters"]["samples"] == 32
    (norm_a,), (norm_b,) = sa["extra"]["reward_fn_norms"].values(), sb["extra"]["reward_fn_norms"].values()
    assert norm_b["count"] == norm_a["count"] == 32  # the reward function's normaliser went on from the saved one


def test_per_rank_batches_and_refusals_word_for_word():
    # 2 prompts and 4 samples per update over 2 ranks, groups of 2: on 1 rank the per-rank batches double
    assert reshard_batches(PPOLayout(1, 2, 2), 1, 2, "S") == PPOLayout(2, 4, 1)
    assert reshard_batches(PPOLayout(2, 2, 1), 2, 1, "S") == PPOLayout(1, 1, 2)
    with pytest.raises(CheckpointError) as e:
        reshard_batches(PPOLayout(1, 2, 2), 3, 2, "S")
    assert str(e.value) == ("--resume S: the saved run took 2 prompts per generation batch and 4 samples per update over its "
                            "2 ranks (1 and 2 per rank), and on 3 ranks 2 prompts per generation batch do not divide by 3 "
                            "ranks; resume on a number of ranks that keeps both: 1 (--per_device_generation_batch_size 2 "
                            "--per_device_training_batch_size 4), 2 (--per_device_generation_batch_size 1 "
                            "--per_device_training_batch_size 2).")
    with pytest.raises(CheckpointError) as e:  # 2 samples per update: 4 ranks cannot share them, 2 would split the groups
        reshard_batches(PPOLayout(4, 2, 1), 4, 2, "S")
    assert str(e.value) == ("--resume S: the saved run took 4 prompts per generation batch and 2 samples per update over its "
                            "1 ranks (4 and 2 per rank), and on 4 ranks 2 samples per update do not divide by 4 ranks; resume "
                            "on a number of ranks that keeps both: 1 (--per_device_generation_batch_size 4 "
                            "--per_device_training_batch_size 2).")
    with pytest.raises(CheckpointError, match="4 samples per rank per update would split the groups of 8 samples"):
        reshard_batches(PPOLayout(4, 8, 1), 2, 8, "S")
    assert reshard_batches(PPOLayout(3, 6, 1), 3, 4, "S") == PPOLayout(1, 2, 3)  # 4 did not divide 6: groups split anyway


def fake_state(tmp_path, world_size=2, **config):
    path = tmp_path / "training_state" / "step_2"
    path.mkdir(parents=True)
    config = {"per_device_generation_batch_size": 1, "per_device_training_batch_size": 2, **config}
    (path / STATE_FILE).write_text(json.dumps({"counters": {"step": 2, "prompts": {"epoch": 0, "index": 2}},
                                               "config": config, "world_size": world_size, "files": {}}))
    return path


def test_resume_layout_refuses_before_anything_loads(tmp_path):
    path = fake_state(tmp_path)
    cfg = SimpleNamespace(per_device_generation_batch_size=1, per_device_training_batch_size=2, resume="auto",
                          output_dir=str(tmp_path), resume_allow_world_size_change=False, group_by_length=True,
                          n_samples_per_prompt=2)
    with pytest.raises(CheckpointError) as e:
        resume_layout(cfg)
    assert "error: " + str(e.value) == REFUSED.format(state=path)
    cfg.resume_allow_world_size_change, cfg.group_by_length = True, False
    with pytest.raises(ConfigError) as e:
        resume_layout(cfg)
    assert str(e.value) == (f"--resume {path}: --resume_allow_world_size_change needs --group_by_length true (its prompt "
                            "order is the same on any number of ranks); resume this run on 2 ranks.")
    cfg.group_by_length = True
    layout = resume_layout(cfg)
    assert layout == PPOLayout(2, 4, 1, state=str(path), saved_world_size=2)
    layout.apply(cfg)
    assert (cfg.per_device_generation_batch_size, cfg.per_device_training_batch_size) == (2, 4)


def test_a_resharded_run_resumed_on_its_own_rank_count_keeps_its_batches(tmp_path):
    path = fake_state(tmp_path, world_size=1)
    saved = json.loads((path / STATE_FILE).read_text())
    (path / STATE_FILE).write_text(json.dumps({**saved, "layout": {"generation_batch": 2, "training_batch": 4}}))
    cfg = SimpleNamespace(per_device_generation_batch_size=1, per_device_training_batch_size=2, resume=str(path),
                          output_dir=str(tmp_path), resume_allow_world_size_change=False, group_by_length=True)
    assert resume_layout(cfg) == PPOLayout(2, 4, 1, state=str(path))
    cfg.per_device_training_batch_size = 1  # other flags (with --resume_allow_config_change): the flags
    assert resume_layout(cfg) == PPOLayout(1, 1, 1, state=str(path))


def test_zero3_ema_shards_are_joined_and_cut_again(tmp_path, monkeypatch):
    """An EMA saved by 2 ranks (ZeRO-3 partitions of 4, 7 elements padded to 8) read by each of 3 ranks, and
    the pure cut, against the whole tensor."""
    whole = torch.arange(1.0, 8.0)
    saved = [whole[:4], torch.cat([whole[4:], torch.zeros(1)])]
    assert torch.equal(recut(saved, 7, 3, 2), torch.tensor([7.0, 0.0, 0.0]))
    assert torch.equal(recut(saved, 7, 7, 0), whole)
    for r, shard in enumerate(saved):
        torch.save({"ema": {"beta": 0.9, "shadow": [shard.clone()]}}, tmp_path / f"extra_rank{r}.pt")
    param = torch.nn.Parameter(torch.zeros(0))
    param.ds_numel, param.ds_tensor = 7, torch.zeros(3)
    ema = SimpleNamespace(params=[param], beta=0.9)
    parts = []
    for rank in range(3):
        monkeypatch.setattr(dist, "rank", lambda rank=rank: rank)
        state = resharded_ema(tmp_path, 2, ema)
        assert state["beta"] == 0.9 and state["shadow"][0].shape == (3,)
        parts.append(state["shadow"][0])
    assert torch.equal(torch.cat(parts)[:7], whole) and torch.equal(torch.cat(parts)[7:], torch.zeros(2))
