"""KTO in step2_dpo (--loss_type kto): labelled rows read as data, a pair split into a desirable and an
undesirable completion, the mismatched rows of the batch, the reference point z0 by hand, and the
program on 2 ranks with ZeRO-3."""

import json
import math

import pytest
import torch

from rlhfkit.data import collate_kto, load_phase_data, tokenize_kto
from test_dpo import PAIRS, dpo_args, read_log
from testutils import run_program

LABELLED = [{"prompt": f"Give me word {i}.", "completion": c, "label": good}
            for i in range(8) for c, good in ((f"The word is {['apple', 'river'][i % 2]}.", True), ("No. Go away.", False))]


def test_labelled_rows_and_pairs_become_completions(tmp_path, tokenizer):
    rows = LABELLED[:4] + [{"prompt": "p", "completion": "c", "label": "yes"}]  # a label that is not true/false
    (tmp_path / "l.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, _, reports = load_phase_data(str(tmp_path / "l.jsonl"), 2, "labelled", data_split="0,1,0", eval_fraction=0.0)
    assert reports[0].format.startswith("prompt/completion/label") and reports[0].skipped == {"bad label": 1}
    assert sorted((ex.prompt[-1]["content"], str(ex.chosen), str(ex.rejected)) for ex in train) == [
        ("Give me word 0.", "None", "No. Go away."), ("Give me word 0.", "The word is apple.", "None"),
        ("Give me word 1.", "None", "No. Go away."), ("Give me word 1.", "The word is river.", "None")]
    (tmp_path / "p.jsonl").write_text(json.dumps(PAIRS[0]) + "\n")
    pairs, _, _ = load_phase_data(str(tmp_path / "p.jsonl"), 2, "labelled", data_split="0,1,0", eval_fraction=0.0)
    feats, report = tokenize_kto(pairs, tokenizer, 64)
    assert report.kept == 1 and [f["desirable"] for f in feats] == [True, False]  # one pair -> two completions
    assert feats[0]["prompt_ids"] == feats[1]["prompt_ids"]
    assert tokenizer.decode(feats[0]["completion_ids"], skip_special_tokens=True) == PAIRS[0]["chosen"]
    with pytest.raises(Exception, match="holds prompts with responses"):  # SFT rows carry no label
        (tmp_path / "s.jsonl").write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n")
        load_phase_data(str(tmp_path / "s.jsonl"), 2, "labelled", data_split="0,1,0")


def test_collate_kto_mismatches_each_prompt_with_the_next_completion():
    feats = [{"prompt_ids": [1, 2], "completion_ids": [7], "desirable": True, "max_seq_len": 4},
             {"prompt_ids": [3], "completion_ids": [8, 9, 5], "desirable": False, "max_seq_len": 4},
             {"prompt_ids": [4, 4, 4], "completion_ids": [6], "desirable": True, "max_seq_len": 4}]
    b = collate_kto(feats, pad_token_id=0)
    # rows 0-2: own completions; rows 3-5: prompt i + completion (i+1) mod 3, cut to max_seq_len 4
    assert b["input_ids"].tolist() == [[1, 2, 7, 0], [3, 8, 9, 5], [4, 4, 4, 6],
                                       [1, 2, 8, 9], [3, 6, 0, 0], [4, 4, 4, 7]]
    assert b["prompt_len"].tolist() == [2, 1, 3, 2, 1, 3]
    assert b["desirable"].tolist() == [True, False, True] and b["kl_weight"].tolist() == [1.0, 1.0, 1.0]
    alone = collate_kto(feats[:1], pad_token_id=0)  # no mismatched pair exists: its row counts nothing
    assert alone["kl_weight"].tolist() == [0.0]


def test_kto_objective_reference_point_by_hand(tiny_dir, tokenizer):
    """z0 = the mean over the mismatched rows of log pi - log ref; the loss is kto_loss at that z0."""
    from rlhfkit.algos import kto_loss
    from rlhfkit.models import load_model, sequence_logprobs
    from step2_dpo.config import DPOConfig
    from step2_dpo.main import KTOObjective

    model = load_model(str(tiny_dir), "causal_lm", dtype="fp32", pad_token_id=tokenizer.pad_token_id)
    feats = [{"prompt_ids": [5, 6], "completion_ids": [7, 8], "desirable": True, "max_seq_len": 8},
             {"prompt_ids": [9], "completion_ids": [10, 11, 12], "desirable": False, "max_seq_len": 8}]
    batch = collate_kto(feats, tokenizer.pad_token_id)
    ref_own, ref_mm = torch.tensor([-20.0, -30.0]), torch.tensor([-25.0, -22.0])
    reference = type("Ref", (), {"logprobs": lambda self, b: (ref_own, ref_mm)})()
    cfg = DPOConfig(model_name_or_path="m", data_path=["d"], output_dir="o", loss_type="kto", beta=0.5, kto_lambda_u=1.5)
    cfg.validate()
    loss, stats = KTOObjective(model, reference, cfg).train_loss(batch)
    own, mm = sequence_logprobs(model, batch)
    kl = ((mm[0] - -25.0) + (mm[1] - -22.0)).item() / 2
    assert stats["kl"] == pytest.approx(kl, rel=1e-5) and stats["z0"] == pytest.approx(max(kl, 0.0), rel=1e-5)
    expected, _ = kto_loss(own, ref_own, torch.tensor([True, False]), kl, 0.5, 1.0, 1.5)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    r = 0.5 * (own - ref_own)
    assert stats["desirable_reward"] == pytest.approx(r[0].item(), rel=1e-5)
    assert stats["undesirable_reward"] == pytest.approx(r[1].item(), rel=1e-5)


@pytest.mark.distributed
def test_kto_zero3_two_ranks_learns_from_pairs_and_labelled_rows(tiny_dir, tmp_path):
    pairs, labelled = tmp_path / "prefs.jsonl", tmp_path / "labelled.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in PAIRS * 4))
    labelled.write_text("".join(json.dumps(r) + "\n" for r in LABELLED))
    out = tmp_path / "kto"
    args = dpo_args(tiny_dir, pairs, out, "--loss_type", "kto", "--zero_stage", "3", "--max_steps", "12", "--eval_interval", "6",
                    "--learning_rate", "1e-3")
    args[args.index("--data_path") + 1:args.index("--data_path") + 2] = [str(pairs), str(labelled)]
    proc = run_program("step2_dpo/main.py", args, nprocs=2)
    train, evals = read_log(out)
    before, after = evals[0], evals[-1]
    assert before["margin"] == 0.0 and before["pairs"] == 8 and "loss" not in before  # policy == reference at step 0
    assert after["accuracy"] > before["accuracy"] and after["margin"] > 0, evals
    assert all(math.isfinite(r["train/kl"]) and r["train/z0"] >= 0 for r in train)
    assert "prompt/completion/label" in proc.stdout
    manifest = json.loads((out / "rlhfkit.json").read_text())
    assert manifest["config"]["loss_type"] == "kto" and manifest["metrics"]["train_completions"] > 0
    bad = run_program("step2_dpo/main.py", dpo_args(tiny_dir, pairs, tmp_path / "b", "--loss_type", "kto",
                                                    "--per_device_train_batch_size", "1"), nprocs=0, check=False)
    assert bad.returncode == 2 and "set --per_device_train_batch_size >= 2" in bad.stderr and "Traceback" not in bad.stderr
