"""Step 2: the score index rule, the reward program on 2 ranks ZeRO-3, export parity, evaluate.py."""

import json
import re
import subprocess
import sys

import pytest
import torch

from rlhfkit.models import (
    head_inputs_at_last_token, load_model, packed_pair_head_inputs, packed_pair_scores, sequence_scores, token_values,
)
from testutils import run_program


@pytest.fixture(scope="module")
def rm(tiny_dir, tokenizer):
    torch.manual_seed(0)
    model = load_model(str(tiny_dir), "reward", dtype="fp32", pad_token_id=tokenizer.pad_token_id).eval()
    model.score.weight.data.normal_(0, 1.0)
    return model


def unpadded_score(model, ids):
    """The score of one sequence with no padding at all: the head's output at its last token."""
    with torch.no_grad():
        return token_values(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0, -1]


def test_score_read_at_last_real_token_any_padding(rm, tokenizer):
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    seqs = [[5, 6, 7, eos],          # response ended with EOS: the score is read at the EOS
            [5, 6, 7, 8, 9, 10],     # cut at max_seq_len (no EOS): the last token before padding
            [11, 12, eos]]
    T = max(map(len, seqs))
    right = torch.tensor([s + [pad] * (T - len(s)) for s in seqs])
    left = torch.tensor([[pad] * (T - len(s)) + s for s in seqs])
    rmask = (torch.arange(T)[None] < torch.tensor([len(s) for s in seqs])[:, None]).long()
    lmask = rmask.flip(-1)
    expected = torch.stack([unpadded_score(rm, s) for s in seqs])
    with torch.no_grad():
        torch.testing.assert_close(sequence_scores(rm, right, rmask), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sequence_scores(rm, left, lmask), expected, rtol=1e-5, atol=1e-5)
        # plain transformers pools at the same token (rightmost non-pad) for right padding
        torch.testing.assert_close(rm(input_ids=right, attention_mask=rmask).logits[:, 0], expected, rtol=1e-5, atol=1e-5)
    # the score is NOT the one a position later (DeepSpeed-Chat's off-by-one) or at the pad
    values = token_values(rm, right, rmask).detach()
    assert not torch.allclose(values[0, 4], expected[0])


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_pairs_score_and_train_like_two_rows(tiny_dir, tokenizer, shared_data, attn):
    """One packed row per pair (prompt once, then chosen, then rejected) gives the scores, the loss
    and the gradients of the chosen and rejected rows run apart (fp32, real hh-rlhf pairs)."""
    from rlhfkit.algos import pairwise_loss
    from rlhfkit.data import collate_packed_pairs, collate_pairs, load_phase_data, tokenize_pairs

    rows, _, _ = load_phase_data(str(shared_data / "hh-rlhf-harmless-base" / "pairs.jsonl.gz"), 2, "pairs")
    features, _ = tokenize_pairs(rows[:4], tokenizer, max_seq_len=96)  # some responses cut, lengths differ
    assert len({len(f["chosen_input_ids"]) + len(f["rejected_input_ids"]) for f in features}) > 1
    torch.manual_seed(0)
    model = load_model(str(tiny_dir), "reward", dtype="fp32", pad_token_id=tokenizer.pad_token_id, attn_implementation=attn)
    model.score.weight.data.normal_(0, 1.0)

    def loss_and_grads(scores):
        model.zero_grad()
        loss, _ = pairwise_loss(*scores)
        loss.backward()
        return scores, loss, [p.grad.clone() for p in model.parameters()]

    apart = collate_pairs(features, tokenizer.pad_token_id)
    flat = sequence_scores(model, apart["input_ids"], apart["attention_mask"])
    ref_scores, ref_loss, ref_grads = loss_and_grads((flat[:len(features)], flat[len(features):]))
    scores, loss, grads = loss_and_grads(packed_pair_scores(model, collate_packed_pairs(features, tokenizer.pad_token_id)))
    torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # what --fit_head_only reads: the head's inputs, packed as apart
        packed_inputs = torch.cat(packed_pair_head_inputs(model, collate_packed_pairs(features, tokenizer.pad_token_id)))
        torch.testing.assert_close(packed_inputs, head_inputs_at_last_token(model, apart["input_ids"], apart["attention_mask"]),
                                   rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for g, ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-5)


PAIRS = [{"prompt": f"Question {i}: is this good?", "chosen": f"Yes, wonderful and helpful answer {i}.",
          "rejected": f"No. Terrible rude reply {i}!"} for i in range(8)]


@pytest.fixture(scope="module")
def pair_data(tmp_path_factory):
    p = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in PAIRS * 3))
    return p


def test_pair_metrics_by_source_hand_computed():
    from rlhfkit.rewards import pair_metrics_by_source

    # pair:           hh 1   hh 2   help 1  help 2
    chosen = torch.tensor([1.0, 0.0, 2.0, 3.0])
    rejected = torch.tensor([0.0, 1.0, 1.0, 4.0])  # right, wrong, right, wrong
    c_len, r_len = torch.tensor([5, 3, 2, 9]), torch.tensor([4, 4, 3, 1])  # chosen longer, shorter, shorter, longer
    m = pair_metrics_by_source(chosen, rejected, c_len, r_len, ["/d/hh/p.jsonl"] * 2 + ["/d/help/p.jsonl"] * 2)
    assert (m["accuracy"], m["pairs"], m["longer_baseline"]) == (0.5, 4, 0.5)
    assert (m["hh/accuracy"], m["hh/pairs"], m["hh/longer_baseline"]) == (0.5, 2, 0.5)
    assert (m["hh/chosen_shorter_pairs"], m["hh/chosen_shorter_accuracy"]) == (1, 0.0)  # hh 2: shorter, wrong
    assert (m["help/chosen_shorter_pairs"], m["help/chosen_shorter_accuracy"]) == (1, 1.0)  # help 1: shorter, right
    assert "hh/margin" not in m
    # one source: no per-source keys
    assert not any("/" in k for k in pair_metrics_by_source(chosen, rejected, c_len, r_len, ["/d/hh/p.jsonl"] * 4))


# a second preference set, in its own directory: its chosen answers are the longer ones
LONGER_PAIRS = [{"prompt": f"Tell me about topic {i}.", "chosen": f"Sure: topic {i} is a long story, told here with care and detail.",
                 "rejected": "Dunno."} for i in range(8)]


@pytest.fixture(scope="module")
def longer_pair_data(tmp_path_factory):
    p = tmp_path_factory.mktemp("longer") / "pairs.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in LONGER_PAIRS * 2))
    return p


@pytest.mark.distributed
def test_reward_program_zero3_learns_exports_and_evaluates(tiny_dir, pair_data, longer_pair_data, tmp_path):
    """Two preference sets: held-out figures for all pairs and for each set, the same as scoring each set alone
    (with the run's --max_per_prompt: each prompt has 3 and 2 rows, 2 kept)."""
    out = tmp_path / "rm"
    args = ["--model_name_or_path", str(tiny_dir), "--data_path", str(pair_data), str(longer_pair_data), "--output_dir", str(out),
            "--data_split", "0,1,0", "--eval_fraction", "0.25", "--max_seq_len", "64", "--dtype", "fp32",
            "--zero_stage", "3", "--learning_rate", "3e-3", "--per_device_train_batch_size", "2", "--num_train_epochs", "4",
            "--lr_scheduler_type", "constant", "--progress_bar", "false", "--max_per_prompt", "2"]
    proc = run_program("step2_reward/main.py", args, nprocs=2)
    assert "8 rows dropped by --max_per_prompt 2" in proc.stdout  # 8 prompts x 3 rows of pair_data -> 16
    rows = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    train_acc = [r["train/accuracy"] for r in rows if "train/accuracy" in r]
    assert sum(train_acc[-3:]) / 3 > 0.75, train_acc  # well above chance on the training pairs
    final = [r for r in rows if "eval/accuracy" in r][-1]
    manifest = json.loads((out / "rlhfkit.json").read_text())
    assert manifest["stage"] == "reward" and manifest["metrics"]["eval_accuracy_after"] == final["eval/accuracy"]
    assert "held-out accuracy" in proc.stdout

    # the export loads with plain transformers and scores like rlhfkit (fp32, 1e-5)
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    plain = AutoModelForSequenceClassification.from_pretrained(out).eval()
    enc = tok(["Hello there, a longer sequence of words", "Short"], padding=True, return_tensors="pt")
    with torch.no_grad():
        theirs = plain(**enc).logits[:, 0]
        ours = sequence_scores(load_model(str(out), "reward", dtype="fp32", pad_token_id=tok.pad_token_id).eval(),
                               enc["input_ids"], enc["attention_mask"])
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)

    # evaluate.py re-creates the held-out pairs and prints the training run's final accuracy
    ev = subprocess.run([sys.executable, "step2_reward/evaluate.py", "--model", str(out)], capture_output=True, text=True,
                        cwd=str(__import__("testutils").REPO))
    assert ev.returncode == 0, ev.stderr[-2000:]
    acc = float(re.search(r"accuracy (\S+)", ev.stdout).group(1))
    assert acc == pytest.approx(final["eval/accuracy"], abs=1e-9) and f"pairs {final['eval/pairs']} " in ev.stdout
    # the same through `rlhfkit score`, then single responses
    ev = subprocess.run([sys.executable, "-m", "rlhfkit.cli", "score", "--model", str(out)], capture_output=True, text=True,
                        cwd=str(__import__("testutils").REPO))
    assert ev.returncode == 0 and float(re.search(r"accuracy (\S+)", ev.stdout).group(1)) == acc, ev.stdout + ev.stderr[-2000:]
    # each set's held-out figures: the step's per-set split of its gathered scores = that set scored alone
    by_source = manifest["metrics"]["eval_by_source"]
    assert sorted(by_source) == sorted([pair_data.parent.name, longer_pair_data.parent.name]), by_source
    assert sum(v["pairs"] for v in by_source.values()) == manifest["metrics"]["eval_pairs"]
    assert by_source[longer_pair_data.parent.name]["longer_baseline"] == 1.0  # every chosen answer is the longer
    for path in (pair_data, longer_pair_data):
        alone = subprocess.run([sys.executable, "-m", "rlhfkit.cli", "score", "--model", str(out), "--data_path", str(path),
                                "--split", "heldout"], capture_output=True, text=True, cwd=str(__import__("testutils").REPO))
        pairs, accuracy = re.search(r"pairs (\d+) \(heldout\)  accuracy (\S+)", alone.stdout).groups()
        mine = by_source[path.parent.name]
        assert (int(pairs), float(accuracy)) == (mine["pairs"], pytest.approx(mine["accuracy"], abs=1e-4)), alone.stdout
    assert f"held-out, {longer_pair_data.parent.name}" in proc.stdout
    ev = subprocess.run([sys.executable, "-m", "rlhfkit.cli", "score", "--model", str(out), "--prompt", "Question 1: is this good?",
                         "--response", "Yes, wonderful and helpful answer 1."], capture_output=True, text=True,
                        cwd=str(__import__("testutils").REPO))
    assert ev.returncode == 0 and re.match(r"-?\d+\.\d{4}\t", ev.stdout), ev.stdout + ev.stderr[-2000:]


class LogRecorder:
    def __init__(self):
        self.logged = []

    def log(self, step, values):
        self.logged.append((step, values))


def test_fit_head_reads_before_and_after_from_one_held_out_pass(tiny_dir, tokenizer, shared_data):
    """--fit_head_only's "before" (the fresh head) and "after" (the fitted head), read from one held-out
    pass, equal two plain evaluations of the model: one before the fit, one after (fp32, real hh pairs)."""
    import functools

    from rlhfkit.data import collate_packed_pairs, collate_pairs, load_phase_data, tokenize_pairs
    from step2_reward.head_fit import fit_head
    from step2_reward.main import PairwiseObjective

    rows, _, _ = load_phase_data(str(shared_data / "hh-rlhf-harmless-base" / "pairs.jsonl.gz"), 2, "pairs")
    features, _ = tokenize_pairs(rows[:40], tokenizer, max_seq_len=96)
    train, held_out = features[:24], features[24:]
    torch.manual_seed(0)
    model = load_model(str(tiny_dir), "reward", dtype="fp32", pad_token_id=tokenizer.pad_token_id).eval()
    model.score.weight.data.normal_(0, 1.0)
    objective = PairwiseObjective(model, pack_pairs=True)
    two_rows = functools.partial(collate_pairs, pad_token_id=tokenizer.pad_token_id)
    plain = functools.partial(objective.evaluate, held_out, two_rows, 5)
    expected_before = plain()
    logger = LogRecorder()
    packed = functools.partial(collate_packed_pairs, pad_token_id=tokenizer.pad_token_id)
    result, report = fit_head(model, train, packed, 4, logger, 1234,
                              functools.partial(objective.evaluate_beside, held_out, two_rows, 5))
    expected_after = plain()
    before, after = result.evals
    assert expected_before["margin"] != pytest.approx(expected_after["margin"], abs=1e-3)  # the fit moved the head
    for got, want in ((before, expected_before), (after, expected_after)):
        assert got["pairs"] == want["pairs"] == 16 and got["accuracy"] == want["accuracy"]
        for key in ("margin", "chosen_score", "rejected_score"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), key
    assert [step for step, _ in logger.logged] == [0, 1] and logger.logged[0][1]["eval/accuracy"] == before["accuracy"]
    assert report["head_fit_l2"] > 0


@pytest.mark.distributed
def test_fit_head_only_zero3_is_the_exact_fit_on_the_models_features(tiny_dir, tokenizer, pair_data, tmp_path):
    """--fit_head_only on 2 ranks under ZeRO-3: the exported head is the linear Bradley-Terry fit on the
    training pairs' features computed by the plain model (same order, same weights), the body is
    untouched, and the held-out accuracy printed is the exported model's."""
    from safetensors.torch import load_file

    from rlhfkit.algos.linear_head import fit_linear_bt_head
    from rlhfkit.data import collate_pairs, load_phase_data, tokenize_pairs
    from rlhfkit.models import head_inputs_at_last_token

    out = tmp_path / "rm"
    args = ["--model_name_or_path", str(tiny_dir), "--data_path", str(pair_data), "--output_dir", str(out),
            "--data_split", "0,1,0", "--eval_fraction", "0.25", "--max_seq_len", "64", "--dtype", "fp32",
            "--zero_stage", "3", "--fit_head_only", "--per_device_eval_batch_size", "3", "--progress_bar", "false"]
    proc = run_program("step2_reward/main.py", args, nprocs=2)
    assert "head fitted on 18 pairs' features" in proc.stdout and "longer answer" in proc.stdout, proc.stdout[-3000:]

    rows, _, _ = load_phase_data(str(pair_data), 2, "pairs", data_split="0,1,0", eval_fraction=0.25)
    feats, _ = tokenize_pairs(rows, tokenizer, 64)
    model = load_model(str(tiny_dir), "reward", dtype="fp32", pad_token_id=tokenizer.pad_token_id).eval()
    batch = collate_pairs(feats, tokenizer.pad_token_id)
    with torch.no_grad():
        h = head_inputs_at_last_token(model, batch["input_ids"], batch["attention_mask"])
    expected, _ = fit_linear_bt_head(*h.chunk(2), seed=1234)
    saved = load_file(str(out / "model.safetensors"))
    torch.testing.assert_close(saved["score.weight"][0].double(), expected, rtol=1e-3, atol=1e-5)
    body = {k: v for k, v in model.state_dict().items() if k != "score.weight"}
    assert all(torch.equal(saved[k], v) for k, v in body.items() if k in saved) and len(saved) == len(body) + 1

    manifest = json.loads((out / "rlhfkit.json").read_text())["metrics"]
    assert manifest["steps"] == 1 and manifest["head_fit_l2"] > 0 and "eval_longer_baseline" in manifest
    ev = subprocess.run([sys.executable, "step2_reward/evaluate.py", "--model", str(out)], capture_output=True, text=True,
                        cwd=str(__import__("testutils").REPO))
    assert float(re.search(r"accuracy (\S+)", ev.stdout).group(1)) == pytest.approx(manifest["eval_accuracy_after"], abs=1e-9)


def test_reward_refuses_a_reward_dir_for_scoring_wrong_stage(tiny_dir, tmp_path):
    d = tmp_path / "sftdir"
    import shutil

    shutil.copytree(tiny_dir, d)
    (d / "rlhfkit.json").write_text(json.dumps({"stage": "sft", "files": {}}))
    proc = subprocess.run([sys.executable, "-m", "rlhfkit.cli", "score", "--model", str(d), "--prompt", "a", "--response", "b"],
                          capture_output=True, text=True, cwd=str(__import__("testutils").REPO))
    assert proc.returncode == 2 and "is a 'sft' checkpoint, but --model expects 'reward' or 'critic'" in proc.stderr


def test_train_top_only_leaves_the_head_the_final_norm_and_the_last_blocks(tiny_dir, tokenizer):
    from rlhfkit.errors import ConfigError
    from rlhfkit.models.freeze import train_top_only

    model = load_model(str(tiny_dir), "reward", dtype="fp32", pad_token_id=tokenizer.pad_token_id)
    assert train_top_only(model, 0) == ["model.norm.weight", "score.weight"]
    top = train_top_only(model, 1)
    assert {n.split(".")[2] for n in top if n.startswith("model.layers.")} == {"1"}  # the tiny model has blocks 0 and 1
    assert "model.embed_tokens.weight" not in top and "score.weight" in top and "model.norm.weight" in top
    with pytest.raises(ConfigError, match="has 2 transformer blocks"):
        train_top_only(model, 3)


@pytest.mark.distributed
def test_reward_program_trains_only_the_top_block_under_zero3(tiny_dir, pair_data, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "rm_top"
    args = ["--model_name_or_path", str(tiny_dir), "--data_path", str(pair_data), "--output_dir", str(out),
            "--data_split", "0,1,0", "--eval_fraction", "0.25", "--max_seq_len", "64", "--dtype", "fp32",
            "--zero_stage", "3", "--learning_rate", "3e-3", "--per_device_train_batch_size", "2", "--max_steps", "3",
            "--lr_scheduler_type", "constant", "--progress_bar", "false", "--train_top_blocks", "1"]
    proc = run_program("step2_reward/main.py", args, nprocs=2)
    assert "training the top 1 blocks, the final norm and the head" in proc.stdout
    before, after = load_file(tiny_dir / "model.safetensors"), load_file(out / "model.safetensors")
    frozen = [k for k in after if k.startswith(("model.embed_tokens.", "model.layers.0."))]
    trained = [k for k in after if k.startswith(("model.layers.1.", "model.norm."))]
    assert frozen and trained
    assert all(torch.equal(before[k], after[k]) for k in frozen), [k for k in frozen if not torch.equal(before[k], after[k])]
    assert any(not torch.equal(before[k], after[k]) for k in trained)
