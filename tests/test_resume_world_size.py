"""Resuming a training state on another number of ranks (--resume_allow_world_size_change): step 1 saved on 1
rank (ZeRO-3, through DeepSpeed's universal checkpoint) resumed on 2; DPO saved on 2 ranks (ZeRO-0) and the reward
model saved on 2 ranks (ZeRO-2) resumed on 1 with twice the accumulation; fp32 on CPU. All keep the objective of each
step exactly (SFT's token mean over the same global micro-batch; DPO's and the reward model's mean over equal
micro-batches of pairs), so the comparison can be tight.

Bit-identity with the uninterrupted run is impossible (reduction order), so what is checked is: the weights right
after loading equal the saved ones exactly; every later step trains on the same rows as the uninterrupted run (its
token and row counts are equal, step by step: nothing skipped or repeated); the loss and the final weights follow the
uninterrupted run within float noise. Also the refusals, word for word."""

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.errors import CheckpointError, ConfigError
from rlhfkit.loaders import LengthGroupedSampler
from rlhfkit.resume import STATE_FILE, RunState, verify_state
from rlhfkit.resume_reshard import Layout, reshard_layout, resume_layout
from test_dpo import dpo_args
from test_reliability import sft_args
from testutils import run_program

# answers of many lengths: a step that trained on other rows than the uninterrupted run's shows in its token count
PAIRS = [{"prompt": f"Question {i}?", "chosen": " ".join(["fine"] * (i + 1)) + ".", "rejected": f"No {i}."}
         for i in range(24)]


@pytest.fixture(scope="module")
def varied(tmp_path_factory):
    p = tmp_path_factory.mktemp("ws") / "pairs.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    return p


def train_rows(out):
    """{step: (loss, tokens so far, samples so far)} from a run's metrics log."""
    rows = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["train/loss"], r["train/tokens"], r["train/samples"]) for r in rows if "train/loss" in r}


def follows(ref, out, first, last):
    """``out`` resumed at step ``first - 1`` trains steps first..last on the rows ``ref`` did, to float noise."""
    a, b = train_rows(ref), train_rows(out)
    assert sorted(b) == list(range(first, last + 1)), sorted(b)
    for step in b:
        assert b[step][1:] == a[step][1:], (step, a[step], b[step])  # same rows: same token and row counts
        assert b[step][0] == pytest.approx(a[step][0], rel=1e-5), (step, a[step], b[step])
    wa, wb = load_file(ref / "model.safetensors"), load_file(out / "model.safetensors")
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-4


REFUSED = ("error: --resume {state}: the run was saved with 2 ranks and this one has 1. A training state resumes on the "
           "same number of ranks unless --resume_allow_world_size_change is passed (--resume_allow_config_change does "
           "not cover it); then the ZeRO state is re-partitioned, the global batch is kept by changing the per-rank "
           "micro-batch or the gradient accumulation, and the run is no longer bit-identical to an uninterrupted one. "
           "Pass --resume_allow_world_size_change, or start 2 ranks (--num_gpus / --num_nodes).")


@pytest.mark.distributed
def test_sft_zero3_saved_on_one_rank_resumes_on_two(tiny_dir, varied, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ref = tmp_path / "ref"
    run_program("step1_sft/main.py", sft_args(tiny_dir, varied, ref), nprocs=0)  # 5 steps, states at 2 and 4
    state = ref / "training_state" / "step_2"
    # resumed with nothing left to train: the exported weights are the saved ones, bit for bit
    loaded = tmp_path / "loaded"
    proc = run_program("step1_sft/main.py", sft_args(tiny_dir, varied, loaded, "--resume", str(state), "--max_steps", "2",
                                                      "--resume_allow_world_size_change"), nprocs=2)
    assert ("[resume] 1 -> 2 ranks: the global batch of 2 rows is kept as 1 per rank x 2 ranks x 1 accumulation (saved: "
            "2 x 1 x 1); continuing 4 rows into epoch 0; rank r takes the RNG streams of saved rank r % 1") in proc.stdout
    saved = get_fp32_state_dict_from_zero_checkpoint(str(state / "model"), tag="ds")
    exported = load_file(loaded / "model.safetensors")
    assert all(torch.equal(exported[k], saved[k]) for k in exported)
    # the conversion went next to the state and is gone; the state is untouched (its hashes hold)
    assert verify_state(state) is None and sorted(p.name for p in state.parent.iterdir()) == ["step_2", "step_4"]
    out = tmp_path / "resumed"
    run_program("step1_sft/main.py", sft_args(tiny_dir, varied, out, "--resume", str(state),
                                              "--resume_allow_world_size_change"), nprocs=2)
    follows(ref, out, 3, 5)
    # its own state records the layout it trained with, for a later resume
    saved_state = json.loads((out / "training_state" / "step_4" / STATE_FILE).read_text())
    assert saved_state["world_size"] == 2
    assert saved_state["layout"] == {"micro_batch": 1, "grad_accum": 1, "order_batch": 2}


@pytest.mark.distributed
def test_dpo_zero0_saved_on_two_ranks_resumes_on_one(tiny_dir, varied, tmp_path):
    def args(out, *extra):
        return dpo_args(tiny_dir, varied, out, "--zero_stage", "0", "--max_steps", "5", "--save_interval", "2", *extra)

    ref = tmp_path / "ref"
    run_program("step2_dpo/main.py", args(ref), nprocs=2)
    state = ref / "training_state" / "step_2"
    for extra in ([], ["--resume_allow_config_change"]):  # refused without the flag; the config flag does not waive it
        proc = run_program("step2_dpo/main.py", args(tmp_path / "no", "--resume", str(state), *extra), nprocs=0, check=False)
        assert proc.returncode == 2 and REFUSED.format(state=state) in proc.stderr, proc.stderr[-2000:]
    out = tmp_path / "resumed"
    proc = run_program("step2_dpo/main.py", args(out, "--resume", str(state), "--resume_allow_world_size_change"), nprocs=0)
    assert ("[resume] 2 -> 1 ranks: the global batch of 4 rows is kept as 2 per rank x 1 ranks x 2 accumulation (saved: "
            "2 x 2 x 1); continuing 8 rows into epoch 0; rank r takes the RNG streams of saved rank r % 2") in proc.stdout
    follows(ref, out, 3, 5)


@pytest.mark.distributed
def test_reward_model_zero2_saved_on_two_ranks_resumes_on_one(tiny_dir, varied, tmp_path):
    """Step 2: the pairwise loss is a mean over equal micro-batches of pairs, so 2 ranks x 1 and 1 rank x 2
    accumulation train the same objective; ZeRO-2's partitioned optimizer goes through the universal checkpoint."""
    def args(out, *extra):
        return ["--model_name_or_path", str(tiny_dir), "--data_path", str(varied), "--output_dir", str(out),
                "--data_split", "0,1,0", "--eval_fraction", "0.25", "--max_seq_len", "64", "--dtype", "fp32",
                "--zero_stage", "2", "--learning_rate", "3e-3", "--lr_scheduler_type", "constant",
                "--per_device_train_batch_size", "2", "--max_steps", "4", "--save_interval", "2", "--progress_bar", "false",
                *extra]

    ref = tmp_path / "ref"
    run_program("step2_reward/main.py", args(ref), nprocs=2)
    state = ref / "training_state" / "step_2"
    out = tmp_path / "resumed"
    proc = run_program("step2_reward/main.py", args(out, "--resume", str(state), "--resume_allow_world_size_change"), nprocs=0)
    assert ("[resume] 2 -> 1 ranks: the global batch of 4 rows is kept as 2 per rank x 1 ranks x 2 accumulation (saved: "
            "2 x 2 x 1); continuing 8 rows into epoch 0; rank r takes the RNG streams of saved rank r % 2") in proc.stdout
    follows(ref, out, 3, 4)


def test_the_data_order_is_the_same_on_any_number_of_ranks():
    """The rows of each global batch, in order, whatever the ranks and micro-batches that cut the saved order."""
    lengths = [(7 * i) % 23 + 1 for i in range(23)]

    def global_rows(batch_size, world, order_batch):
        ranks = [list(LengthGroupedSampler(lengths, batch_size, 5, world=world, rank=r, order_batch=order_batch))
                 for r in range(world)]
        steps = len(ranks[0]) // batch_size
        return [i for s in range(steps) for r in ranks for i in r[s * batch_size:(s + 1) * batch_size]]

    two_ranks = global_rows(2, 2, None)
    assert sorted(set(two_ranks)) == list(range(23)) and len(two_ranks) == 24  # the tail wraps around
    assert global_rows(4, 1, 4) == global_rows(2, 1, 4) == global_rows(1, 4, 4) == global_rows(1, 2, 4) == two_ranks
    assert global_rows(2, 1, None) != two_ranks  # a plain run of 2-row global batches orders by those


def test_layout_choices_and_refusals_word_for_word():
    # shrinking keeps the per-rank micro-batch and accumulates more; growing shrinks the micro-batch
    assert reshard_layout(Layout(2, 1, 2, 4), 1, 2, 8, "S") == Layout(2, 2, 1, 4)
    assert reshard_layout(Layout(2, 1, 1, 2), 2, 2, 4, "S") == Layout(1, 1, 2, 2)
    assert reshard_layout(Layout(2, 2, 1, 4), 2, 2, 0, "S") == Layout(2, 1, 2, 4)
    with pytest.raises(CheckpointError) as e:
        reshard_layout(Layout(2, 1, 2, 4), 3, 2, 0, "S")
    assert str(e.value) == ("--resume S: the saved run's global batch of 4 rows (2 per rank x 2 ranks x 1 accumulation) "
                            "does not divide by 3 ranks, so it cannot be kept; resume on a number of ranks that divides 4 "
                            "(1, 2, 4).")
    with pytest.raises(CheckpointError) as e:
        reshard_layout(Layout(1, 4, 1, 1), 2, 1, 6, "S")
    assert str(e.value) == ("--resume S: the saved run's data order is built from global batches of 1 rows and it stopped "
                            "6 rows into its epoch, which 2 ranks cannot share evenly from there on; resume on a number of "
                            "ranks that divides 1 (1).")


def fake_state(tmp_path, world_size=2, **config):
    path = tmp_path / "training_state" / "step_2"
    path.mkdir(parents=True)
    config = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, **config}
    (path / STATE_FILE).write_text(json.dumps({"counters": {"step": 2, "epoch": 0, "batch_in_epoch": 2}, "config": config,
                                               "world_size": world_size, "files": {}}))
    return path


def test_refusals_before_anything_loads_word_for_word(tmp_path):
    """One process (world size 1) and a state saved by 2 ranks: refused without the flag, refused without
    --group_by_length, refused always by a run state without a batch layout (no program re-cuts its batches)."""
    path = fake_state(tmp_path)
    cfg = SimpleNamespace(per_device_train_batch_size=2, gradient_accumulation_steps=1, resume="auto", output_dir=str(tmp_path),
                          resume_allow_world_size_change=False, group_by_length=True)
    with pytest.raises(CheckpointError) as e:
        resume_layout(cfg)
    assert "error: " + str(e.value) == REFUSED.format(state=path)
    cfg.resume_allow_world_size_change, cfg.group_by_length = True, False
    with pytest.raises(ConfigError) as e:
        resume_layout(cfg)
    assert str(e.value) == (f"--resume {path}: --resume_allow_world_size_change needs --group_by_length true (its data order "
                            "is the same on any number of ranks); resume this run on 2 ranks.")
    cfg.group_by_length = True
    assert resume_layout(cfg) == Layout(2, 2, 1, 4, state=str(path), saved_world_size=2, saved_micro_rows=4)
    no_layout = RunState(str(tmp_path), {}, {"resume_allow_world_size_change": True}, resume="auto")
    with pytest.raises(CheckpointError) as e:
        no_layout.restore()
    assert str(e.value) == (f"--resume {path}: the run was saved with 2 ranks and this one has 1, and this program resumes "
                            "on the same number of ranks only: start 2 ranks (--num_gpus / --num_nodes).")


def test_same_world_size_keeps_the_saved_layout(tmp_path):
    """A run resumed on 1 rank from 2 saves its layout (2 x 1 x 2, order 4); resumed again on 1 rank, it keeps it."""
    path = fake_state(tmp_path, world_size=1)
    state = json.loads((path / STATE_FILE).read_text())
    state["layout"] = {"micro_batch": 2, "grad_accum": 2, "order_batch": 4}
    (path / STATE_FILE).write_text(json.dumps(state))
    cfg = SimpleNamespace(per_device_train_batch_size=2, gradient_accumulation_steps=1, resume=str(path),
                          output_dir=str(tmp_path), resume_allow_world_size_change=False, group_by_length=True)
    assert resume_layout(cfg) == Layout(2, 2, 1, 4, state=str(path))
    cfg.resume = None
    assert resume_layout(cfg) == Layout(2, 1, 1, 2)
