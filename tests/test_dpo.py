"""DPO (step2_dpo/main.py) through the real program on a tiny random Llama, plus the summed response
log-probs it trains on (rlhfkit.models.scores)."""

import json
import math
import os

import pytest
import torch

from rlhfkit.algos import IGNORE_INDEX
from rlhfkit.models import (
    at_predicting_column, packed_sequence_logprobs, pair_response_lengths, response_labels, sequence_logprobs,
)
from test_step1_sft import load_plain
from testutils import run_program

WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "ocean", "lemon"]
PAIRS = [{"prompt": f"Say the word number {i}.", "chosen": f"The word is {w}.",
          "rejected": "No. I refuse to help you with that, go away."} for i, w in enumerate(WORDS)]


@pytest.fixture(scope="module")
def pref_data(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "prefs.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in PAIRS * 4))  # 32 rows: 24 train, 8 held out
    return p


def dpo_args(model, data, out, *extra):
    return ["--model_name_or_path", str(model), "--data_path", str(data), "--output_dir", str(out),
            "--data_split", "0,1,0", "--eval_fraction", "0.25", "--max_seq_len", "64", "--dtype", "fp32",
            "--learning_rate", "3e-3", "--lr_scheduler_type", "constant", "--per_device_train_batch_size", "2",
            "--progress_bar", "false", *extra]


def read_log(out):
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    evals = [{k[5:]: v for k, v in r.items() if k.startswith("eval/")} | {"step": r["step"]}
             for r in rows if "eval/pairs" in r]
    train = [r for r in rows if "train/loss" in r]
    return train, evals


@pytest.mark.distributed
def test_dpo_zero3_two_ranks_learns_preferences(tiny_dir, pref_data, tmp_path):
    out = tmp_path / "dpo"
    proc = run_program("step2_dpo/main.py", dpo_args(tiny_dir, pref_data, out, "--zero_stage", "3", "--max_steps", "6",
                                                     "--eval_interval", "3", "--dtype", "bf16"), nprocs=2)
    train, evals = read_log(out)
    assert [e["step"] for e in evals] == [0, 3, 6]
    before, after = evals[0], evals[-1]
    # step 0: policy == reference (same weights, same attention kernel), so in bf16 too every implicit
    # reward is exactly 0 and the loss is -log sigmoid(0) = log 2
    assert before["margin"] == 0.0 and before["chosen_reward"] == 0.0 and before["rejected_reward"] == 0.0, before
    assert before["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert before["pairs"] == 8 and after["pairs"] == 8
    # training prefers the chosen answers on the held-out pairs
    assert after["accuracy"] > before["accuracy"] and after["accuracy"] >= 0.75, evals
    assert after["margin"] > 0.5 and after["margin"] == pytest.approx(after["chosen_reward"] - after["rejected_reward"])
    assert after["loss"] < 0.8 * before["loss"], evals
    assert train[-1]["train/loss"] < train[0]["train/loss"] and train[-1]["train/margin"] > 0
    assert "accuracy 0.000 ->" in proc.stdout and "reference ZeRO-3, its forwards on a gathered copy\n" in proc.stdout

    manifest = json.loads((out / "rlhfkit.json").read_text())
    assert manifest["stage"] == "dpo" and manifest["parent"]["path"] == os.path.abspath(tiny_dir)
    assert manifest["zero_stage"] == 3 and manifest["world_size"] == 2 and manifest["data"][0]["rows"] == 32
    m = manifest["metrics"]
    assert m["eval_accuracy_after"] == after["accuracy"] and m["eval_margin_before"] == before["margin"]
    assert m["steps"] == 6 and m["train_pairs"] == 6 * 2 * 2
    assert manifest["config"]["beta"] == 0.1 and manifest["config"]["loss_type"] == "sigmoid"
    load_plain(out)


def test_dpo_ipo_one_rank_zero0_lora_offloaded_reference(tiny_dir, pref_data, tmp_path):
    out = tmp_path / "ipo"
    proc = run_program("step2_dpo/main.py", dpo_args(tiny_dir, pref_data, out, "--zero_stage", "0", "--max_steps", "1",
                                                     "--loss_type", "ipo", "--beta", "0.1", "--offload_reference_model",
                                                     "--lora_dim", "4", "--only_optimize_lora"), nprocs=1)
    train, evals = read_log(out)
    assert len(train) == 1 and [e["step"] for e in evals] == [0, 1]
    # IPO at step 0: h = 0, loss = (0 - 1 / (2 beta))^2 = 25
    assert evals[0]["loss"] == pytest.approx((0 - 1 / (2 * 0.1)) ** 2, abs=1e-3)
    assert evals[1]["loss"] < evals[0]["loss"]
    assert "reference ZeRO-3, offloaded to CPU" in proc.stdout
    manifest = json.loads((out / "rlhfkit.json").read_text())
    assert manifest["stage"] == "dpo" and manifest["config"]["loss_type"] == "ipo" and manifest["metrics"]["steps"] == 1
    load_plain(out)  # LoRA merged into plain weights


def test_simpo_is_reference_free_and_learns_preferences(tiny_dir, pref_data, tmp_path):
    out = tmp_path / "simpo"
    proc = run_program("step2_dpo/main.py", dpo_args(tiny_dir, pref_data, out, "--loss_type", "simpo", "--max_steps", "6",
                                                     "--learning_rate", "1e-3"), nprocs=0)
    assert "no reference model (simpo)" in proc.stdout and "reference ZeRO" not in proc.stdout
    train, evals = read_log(out)
    before, after = evals[0], evals[-1]
    # held-out rewards are beta / |y| * log pi(y|x) with beta 2 (SimPO's default); the policy learns the chosen side
    assert before["chosen_reward"] < 0 and before["rejected_reward"] < 0
    assert after["accuracy"] > before["accuracy"] and after["loss"] < before["loss"], evals
    config = json.loads((out / "rlhfkit.json").read_text())["config"]
    assert (config["loss_type"], config["beta"], config["simpo_gamma"]) == ("simpo", 2.0, 1.0)


def test_loss_type_defaults():
    from step2_dpo.config import DPOConfig

    def validated(**flags):
        cfg = DPOConfig(model_name_or_path="m", data_path=["d"], output_dir="o", **flags)
        cfg.validate()
        return cfg

    cdpo = validated(loss_type="cdpo")  # conservative DPO: the sigmoid loss with label smoothing 0.1 unless given
    assert (cdpo.loss_type, cdpo.label_smoothing, cdpo.beta, cdpo.uses_reference) == ("sigmoid", 0.1, 0.1, True)
    assert validated(loss_type="cdpo", label_smoothing=0.2).label_smoothing == 0.2
    simpo = validated(loss_type="simpo")
    assert (simpo.beta, simpo.simpo_gamma, simpo.uses_reference) == (2.0, 1.0, False)
    assert validated(loss_type="simpo", beta=2.5).beta == 2.5


def test_bad_dpo_flags_fail_clearly(tiny_dir, pref_data, tmp_path):
    proc = run_program("step2_dpo/main.py", dpo_args(tiny_dir, pref_data, tmp_path / "o", "--loss_type", "ipo",
                                                     "--label_smoothing", "0.1"), nprocs=0, check=False)
    assert proc.returncode == 2 and "--label_smoothing applies to --loss_type sigmoid only" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_program("step2_dpo/main.py", dpo_args(tiny_dir, pref_data, tmp_path / "o", "--keep_reference_copy",
                                                     "--reference_on_copy", "false"), nprocs=0, check=False)
    assert proc.returncode == 2 and "--keep_reference_copy keeps the copy of --reference_on_copy" in proc.stderr


def test_response_labels_by_hand():
    """Position t holds token t+1 when that token is a real response token (index >= prompt_len, not
    padding): the logits at t predict it. Everything else is IGNORE_INDEX."""
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 0], [9, 10, 11, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]]), "prompt_len": torch.tensor([2, 1])}
    x = IGNORE_INDEX
    # row 0: response tokens 7 (index 2), 8 (index 3); row 1: 10 (index 1), 11 (index 2)
    assert response_labels(batch).tolist() == [[x, 7, 8, x, x], [10, 11, x, x, x]]
    assert at_predicting_column(torch.tensor([[1, 2, 3], [4, 5, 6]]), 0).tolist() == [[2, 3, 0], [5, 6, 0]]


def test_sequence_logprobs_sum_response_tokens_only(tiny_dir):
    """Summed response log-probs against a naive loop: prompt and padding count nothing."""
    from transformers import AutoModelForCausalLM

    from rlhfkit.data import collate_pairs

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    features = [{"chosen_input_ids": [5, 6, 7, 8, 9, 10], "rejected_input_ids": [5, 6, 7, 11], "prompt_len": 3},
                {"chosen_input_ids": [12, 13, 14, 15, 16, 17, 18], "rejected_input_ids": [12, 13, 14, 15, 16, 19, 20, 21],
                 "prompt_len": 5}]
    batch = collate_pairs(features, pad_token_id=0)
    with torch.no_grad():
        chosen, rejected = sequence_logprobs(model, batch)
        expected = []
        for seq, plen in [(f["chosen_input_ids"], f["prompt_len"]) for f in features] + \
                         [(f["rejected_input_ids"], f["prompt_len"]) for f in features]:
            logp = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
            expected.append(sum(logp[t - 1, seq[t]].item() for t in range(plen, len(seq))))
    torch.testing.assert_close(torch.cat([chosen, rejected]), torch.tensor(expected), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_pairs_give_the_logprobs_and_gradients_of_two_rows(tiny_dir, tokenizer, shared_data, attn):
    """One packed row per pair (prompt once, then chosen, then rejected) gives the summed response
    log-probs, the DPO loss and every gradient of the chosen and rejected rows run apart (fp32, real
    hh-rlhf pairs, some cut so that a side is short or empty)."""
    from rlhfkit.algos import dpo_loss
    from rlhfkit.data import collate_packed_pairs, collate_pairs, load_phase_data, tokenize_pairs
    from rlhfkit.models import load_model

    rows, _, _ = load_phase_data(str(shared_data / "hh-rlhf-harmless-base" / "pairs.jsonl.gz"), 2, "pairs")
    features, _ = tokenize_pairs(rows[:4], tokenizer, max_seq_len=96)
    features.append({**features[0], "rejected_input_ids": features[0]["chosen_input_ids"][:features[0]["prompt_len"]]})
    model = load_model(str(tiny_dir), "causal_lm", dtype="fp32", pad_token_id=tokenizer.pad_token_id, attn_implementation=attn)
    ref = (torch.linspace(-30, -20, len(features)), torch.linspace(-25, -35, len(features)))

    def run(logprobs, batch):
        model.zero_grad()
        chosen, rejected = logprobs(model, batch)
        loss, _, _ = dpo_loss(chosen, rejected, *ref, beta=0.1)
        loss.backward()
        return chosen.detach(), rejected.detach(), loss.detach(), [p.grad.clone() for p in model.parameters()]

    unpacked, packed = collate_pairs(features, tokenizer.pad_token_id), collate_packed_pairs(features, tokenizer.pad_token_id)
    want = run(sequence_logprobs, unpacked)
    got = run(packed_sequence_logprobs, packed)
    assert want[1][-1] == 0  # the empty rejected side sums nothing, packed or not
    # SimPO's lengths: the response tokens each side sums, the same from either layout, counted by hand here
    lengths = [torch.tensor([len(f[k]) - f["prompt_len"] for f in features]) for k in ("chosen_input_ids", "rejected_input_ids")]
    for batch in (unpacked, packed):
        got_lengths = pair_response_lengths(batch)
        assert all(torch.equal(g, w) for g, w in zip(got_lengths, lengths)) and lengths[1][-1] == 0
    for g, w in zip(got[:3], want[:3]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)
    for g, w in zip(got[3], want[3]):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("program", ["step2_reward/main.py", "step2_dpo/main.py"])
def test_pair_packing_refuses_flash_attention(tiny_dir, pref_data, tmp_path, program):
    proc = run_program(program, dpo_args(tiny_dir, pref_data, tmp_path / "o", "--attn_implementation", "flash_attention_2"),
                       nprocs=0, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert ("--pack_pairs needs an attention kernel that takes a 4D mask (eager, sdpa); with --attn_implementation "
            "flash_attention_2 pass --pack_pairs false") in proc.stderr
