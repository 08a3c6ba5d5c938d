"""Bad input and bad setup, driven through the real programs: one clear message each, exit status 2,
no Python traceback, nothing written (issue: reliability)."""

import json
import os

import pytest

from testutils import run_program


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "unknown.jsonl").write_text('{"foo": 1, "bar": 2}\n')
    (d / "zero.jsonl").write_text('{"prompt": "x", "chosen": "", "rejected": ""}\n{"prompt": "", "chosen": "", "rejected": "y"}\n')
    (d / "long.jsonl").write_text("".join(json.dumps({"prompt": "word " * 400}) + "\n" for _ in range(5)))
    (d / "ok.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": f"a{i}", "rejected": f"b{i}"}) + "\n" for i in range(10)))
    (d / "a_file").write_text("x")
    (d / "raises.py").write_text("def reward(prompts, responses, rows):\n    raise ValueError('boom')\n")
    (d / "nan_reward.py").write_text("def reward(prompts, responses, rows):\n    return [float('nan')] * len(responses)\n")
    return d


CASES = {
    "missing data file": ("step1", ["--data_path", "{d}/nope.jsonl"], "data file not found: {d}/nope.jsonl"),
    "unknown format": ("step1", ["--data_path", "{d}/unknown.jsonl"], "unknown data format (jsonl); fields found: bar, foo"),
    "zero usable rows": ("step1", ["--data_path", "{d}/zero.jsonl", "--data_split", "1,0,0"], "no usable rows"),
    "all prompts too long": ("step3", ["--data_path", "{d}/long.jsonl", "--max_prompt_seq_len", "64"], "no example survived tokenisation"),
    "split leaves a step no data": ("step2", ["--data_path", "{d}/ok.jsonl", "--data_split", "1,0,0"],
                                    "--data_split 1,0,0 gives step 2 (reward model) no share of the data"),
    "output dir not writable": ("step1", ["--data_path", "{d}/ok.jsonl", "--output_dir", "{d}/a_file/out"], "is not writable"),
    "model dir missing": ("step1", ["--data_path", "{d}/ok.jsonl", "--model_name_or_path", "{d}/nomodel"],
                          "--model_name_or_path {d}/nomodel: no such directory"),
    "not a model": ("step1", ["--data_path", "{d}/ok.jsonl", "--model_name_or_path", "{d}"], "not a model directory, no config.json"),
    "zero stage out of range": ("step1", ["--data_path", "{d}/ok.jsonl", "--zero_stage", "7"], "--zero_stage 7 is out of range"),
    "CUDA-only option on CPU": ("step3", ["--data_path", "{d}/ok.jsonl", "--enable_hybrid_engine"], "needs CUDA"),
    "offload without ZeRO": ("step1", ["--data_path", "{d}/ok.jsonl", "--offload"], "--offload needs --zero_stage 1, 2 or 3"),
    "reward function raises": ("step3", ["--data_path", "{d}/ok.jsonl", "--reward_fn", "raises:reward"],
                               "reward function raises:reward raised ValueError: boom on sample 0"),
    "reward function returns nan": ("step3", ["--data_path", "{d}/ok.jsonl", "--reward_fn", "nan_reward:reward:2"],
                                    "reward function nan_reward:reward returned nan for sample 0"),
    "unknown reward function": ("step3", ["--data_path", "{d}/ok.jsonl", "--reward_fn", "nosuchmod:fn"], "cannot import module nosuchmod"),
}


def base_args(program, tiny_dir, d):
    if program == "step3":
        return ("step3_ppo/main.py", ["--actor_model_name_or_path", str(tiny_dir), "--algo", "reinforce_pp", "--reward_fn", "gsm8k",
                                      "--data_split", "0,0,1", "--output_dir", f"{d}/out", "--max_steps", "1", "--dtype", "fp32",
                                      "--per_device_generation_batch_size", "1", "--per_device_training_batch_size", "1",
                                      "--max_answer_seq_len", "4", "--max_eval_samples", "1", "--progress_bar", "false"])
    script = {"step1": "step1_sft/main.py", "step2": "step2_reward/main.py"}[program]
    return script, ["--model_name_or_path", str(tiny_dir), "--output_dir", f"{d}/out", "--dtype", "fp32", "--max_steps", "1"]


def merged(args, extra):
    """Later flags win: drop the earlier occurrence of any flag that `extra` sets again."""
    out, i = [], 0
    override = {a for a in extra if a.startswith("--")}
    while i < len(args):
        if args[i] in override:
            i += 2 if i + 1 < len(args) and not args[i + 1].startswith("--") else 1
            continue
        out.append(args[i])
        i += 1
    return out + extra


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_message(case, files, tiny_dir):
    program, extra, message = CASES[case]
    script, args = base_args(program, tiny_dir, files)
    extra = [e.format(d=files) for e in extra]
    proc = run_program(script, merged(args, extra), nprocs=0, check=False,
                       env_extra={"PYTHONPATH": f"{files}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert proc.returncode == 2, (case, proc.returncode, proc.stderr[-3000:])
    assert message.format(d=files) in proc.stderr, (case, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, (case, proc.stderr[-3000:])
    assert not (files / "out" / "rlhfkit.json").exists()


def test_unknown_flag(tiny_dir, files):
    script, args = base_args("step1", tiny_dir, files)
    proc = run_program(script, args + ["--data_path", f"{files}/ok.jsonl", "--learning_rat", "1"], nprocs=0, check=False)
    assert proc.returncode == 2 and "unrecognized arguments: --learning_rat 1" in proc.stderr and "Traceback" not in proc.stderr


def test_not_enough_disk_is_checked_before_saving(tmp_path):
    from rlhfkit.checkpoint import check_free_space
    from rlhfkit.errors import CheckpointError

    with pytest.raises(CheckpointError, match="not enough disk space .* the previous checkpoint is kept"):
        check_free_space(tmp_path, 1 << 62)
