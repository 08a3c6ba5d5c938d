"""Step 1 through the real program: 1 rank ZeRO-0 and 2 ranks ZeRO-3 on a tiny random Llama."""

import json
import shutil
import subprocess
import sys

import pytest

from testutils import REPO, run_program

MEMO = [{"prompt": f"Say the word number {i}.", "response": f"The word is {w}."}
        for i, w in enumerate(["apple", "river", "stone", "cloud", "maple", "tiger", "ocean", "lemon"])]


@pytest.fixture(scope="module")
def memo_data(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "memo.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in MEMO * 2))
    return p


def sft_args(model, data, out, *extra):
    return ["--model_name_or_path", str(model), "--data_path", str(data), "--output_dir", str(out), "--data_split", "1,0,0",
            "--eval_fraction", "0.2", "--max_seq_len", "64", "--dtype", "fp32", "--learning_rate", "3e-3",
            "--per_device_train_batch_size", "2", "--num_train_epochs", "6", "--lr_scheduler_type", "constant",
            "--progress_bar", "false", "--log_interval", "1", *extra]


def metrics(out):
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = [r["train/loss"] for r in rows if "train/loss" in r]
    evals = [r["eval/perplexity"] for r in rows if "eval/perplexity" in r]
    return train, evals


PLAIN_LOAD = r"""
import sys
sys.modules["rlhfkit"] = None  # prove the directory needs no rlhfkit
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1]); model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
ids = tok.apply_chat_template([{"role": "user", "content": "Say the word number 3."}], add_generation_prompt=True,
                              return_tensors="pt", return_dict=True)
out = model.generate(**ids, max_new_tokens=8, do_sample=False)
assert out.shape[1] > ids["input_ids"].shape[1]
print("OK", tok.decode(out[0, ids["input_ids"].shape[1]:]))
"""


def load_plain(out):
    proc = subprocess.run([sys.executable, "-c", PLAIN_LOAD, str(out)], capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0 and proc.stdout.startswith("OK"), proc.stderr[-3000:]


@pytest.mark.parametrize("ranks,zero", [(1, 0), pytest.param(2, 3, marks=pytest.mark.distributed)])
def test_sft_learns_and_exports(tiny_dir, memo_data, tmp_path, ranks, zero):
    out = tmp_path / f"sft-{ranks}-{zero}"
    proc = run_program("step1_sft/main.py", sft_args(tiny_dir, memo_data, out, "--zero_stage", str(zero)), nprocs=ranks)
    train, evals = metrics(out)
    assert train[-1] < 0.7 * train[0], train  # loss falls on the memorised set
    assert evals[-1] < evals[0], evals
    assert "eval perplexity" in proc.stdout and "checkpoint" in proc.stdout
    manifest = json.loads((out / "rlhfkit.json").read_text())
    assert manifest["stage"] == "sft" and manifest["zero_stage"] == zero and manifest["world_size"] == ranks
    assert manifest["metrics"]["eval_perplexity_after"] < manifest["metrics"]["eval_perplexity_before"]
    assert manifest["data"][0]["rows"] == 16
    load_plain(out)


def test_half_written_model_dir_is_refused(tiny_dir, memo_data, tmp_path):
    half = tmp_path / "half"
    shutil.copytree(tiny_dir, half)
    (half / "rlhfkit.json").write_text(json.dumps({"stage": "sft", "files": {"model.safetensors": {"sha256": "0", "bytes": 1}}}))
    proc = run_program("step1_sft/main.py", sft_args(half, memo_data, tmp_path / "o"), nprocs=0, check=False)
    assert proc.returncode == 2
    assert "error: --model_name_or_path" in proc.stderr and "half-written or corrupted, model.safetensors" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_wrong_stage_is_refused(tiny_dir, memo_data, tmp_path):
    rm = tmp_path / "rm"
    shutil.copytree(tiny_dir, rm)
    (rm / "rlhfkit.json").write_text(json.dumps({"stage": "reward", "files": {}}))
    proc = run_program("step1_sft/main.py", sft_args(rm, memo_data, tmp_path / "o"), nprocs=0, check=False)
    assert proc.returncode == 2 and "is a 'reward' checkpoint" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.distributed
def test_zero3_block_leaves_train_like_zero2_with_lora_and_checkpointing(tiny_dir, memo_data, tmp_path):
    """ZeRO-3 gathers each transformer block as one unit (rlhfkit.training.zero3_block_leaves); with
    LoRA and gradient checkpointing on, 2 ranks ZeRO-3 give the losses of 2 ranks ZeRO-2 (fp32)."""
    losses = {}
    for zero in (2, 3):
        out = tmp_path / f"z{zero}"
        proc = run_program("step1_sft/main.py", sft_args(tiny_dir, memo_data, out, "--zero_stage", str(zero), "--max_steps", "4",
                                                         "--lora_dim", "8", "--gradient_checkpointing"), nprocs=2)
        losses[zero] = metrics(out)[0]
    assert "LlamaDecoderLayer" in proc.stdout  # the program says which blocks became leaves
    assert len(losses[3]) == 4 and losses[3] != [losses[3][0]] * 4
    assert losses[3] == pytest.approx(losses[2], rel=1e-4), losses


@pytest.mark.parametrize("only_lora", [False, True])
def test_zero3_lora_trains_in_bf16(tiny_dir, memo_data, tmp_path, only_lora):
    """One rank, ZeRO-3, bf16, LoRA, no checkpointing: the adapters are in the weights' dtype (ZeRO-3 flattens
    a group into one dtype), and with only the adapters training (frozen embedding) ZeRO-3 still gathers
    each block for its backward. Both ran into errors before; the losses follow ZeRO-2's."""
    lora = ("--lora_dim", "8", "--max_steps", "4", "--dtype", "bf16") + (("--only_optimize_lora",) if only_lora else ())
    losses = {}
    for zero in (2, 3):
        out = tmp_path / f"z{zero}"
        run_program("step1_sft/main.py", sft_args(tiny_dir, memo_data, out, "--zero_stage", str(zero), *lora), nprocs=1)
        losses[zero] = metrics(out)[0]
    assert len(losses[3]) == 4 and losses[3][-1] < losses[3][0], losses
    assert losses[3] == pytest.approx(losses[2], rel=2e-2), losses
