"""The bash launchers (launch/*.sh): the deepspeed command lines they build, and a real two-node run.

The fast tests run every script with DRY_RUN=1 (print the commands, run nothing) and
RLHFKIT_NO_SETUP=1 (no venv setup), with a fake `nvidia-smi` first on PATH so that GPU detection
is the same on every machine, and compare the printed command lines word for word.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from testutils import HH, REPO, VENV_BIN, env_for_ranks, free_port, require_data

LAUNCH = REPO / "launch"
DEEPSPEED = str(VENV_BIN / "deepspeed")
DEFAULT_DATA = str((REPO / ".." / "shared" / "data" / "hh-rlhf-harmless-base" / "pairs.jsonl.gz").resolve())
LAUNCHER_VARS = ("NUM_GPUS", "NUM_RANKS", "NUM_NODES", "NODE_RANK", "HOSTFILE", "MASTER_ADDR", "MASTER_PORT", "NO_SSH",
                 "RLHFKIT_CPU", "DEEPSPEED_ARGS", "DEEPSPEED", "OMP_NUM_THREADS", "OMP_THREAD_LIMIT",
                 "CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR", "RK_SETUP_DONE", "DRY_RUN")
NOT_OURS = {"setup_env.sh", "run_tests.sh"}  # checked by their own owners
SCRIPTS = sorted(str(p.relative_to(REPO)) for p in LAUNCH.rglob("*.sh") if p.name not in NOT_OURS or p.parent != LAUNCH)


def cores() -> int:
    return len(os.sched_getaffinity(0))


def threads(ranks: int) -> str:
    return f"OMP_NUM_THREADS={max(1, cores() // ranks)}"


@pytest.fixture
def launch_env(tmp_path):
    """Run a launcher script in dry-run mode; ``gpus`` fakes what nvidia-smi finds."""

    def run(script: str, *args: str, gpus: int = 0, check: bool = True, **env_vars: str):
        fake_bin = tmp_path / f"fake-bin-{gpus}"
        fake_bin.mkdir(exist_ok=True)
        smi = fake_bin / "nvidia-smi"
        lines = "".join(f"echo 'GPU {i}: Fake GPU (UUID: GPU-{i})'\n" for i in range(gpus))
        smi.write_text("#!/bin/sh\n" + (lines or "exit 9\n"))
        smi.chmod(0o755)
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
        env.update(DRY_RUN="1", RLHFKIT_NO_SETUP="1", VENV=str(VENV_BIN.parent), TMPDIR=str(tmp_path),
                   PATH=f"{fake_bin}{os.pathsep}{env.get('PATH', '')}")
        env.update(env_vars)
        proc = subprocess.run(["bash", str(REPO / script), *args], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=60)
        if check:
            assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        return proc

    return run


def commands(stdout: str) -> list[list[str]]:
    """The command lines the launchers printed, each split into words."""
    return [shlex.split(line[len("[launch] "):]) for line in stdout.splitlines()
            if line.startswith("[launch] ") and any(w in line for w in ("/main.py", " prepare-base ", " make-arithmetic "))]


def one_stage(stdout: str) -> list[str]:
    cmds = [c for c in commands(stdout) if any(w.endswith("/main.py") for w in c)]
    assert len(cmds) == 1, stdout
    return cmds[0]


def split_port(cmd: list[str]) -> tuple[list[str], int]:
    """Take out ``--master_port P`` (a free port unless given) and return it."""
    i = cmd.index("--master_port")
    port = int(cmd[i + 1])
    assert 0 < port < 65536
    return cmd[:i] + cmd[i + 2:], port


# ---------------------------------------------------------------------------------------------
# flag mapping and pass-through


def test_step1_flags_and_passthrough(launch_env, tmp_path):
    out = launch_env("launch/step1_sft.sh", "--model", "/m/base", "--data", "a.jsonl", "b.jsonl", "--output", "out1",
                     "--zero_stage=2", "--max_steps", "7", "--lora_dim", "8", "--gradient_checkpointing",
                     "--learning_rate=3e-5", MASTER_PORT="29601").stdout
    assert one_stage(out) == [
        threads(2), DEEPSPEED, "--num_gpus", "2", "--master_port", "29601", f"{REPO}/step1_sft/main.py",
        "--model_name_or_path", "/m/base", "--data_path", "a.jsonl", "b.jsonl", "--output_dir", "out1",
        "--zero_stage", "2", "--dtype", "bf16",
        "--max_steps", "7", "--lora_dim", "8", "--gradient_checkpointing", "--learning_rate=3e-5"]
    assert "prepare-base" not in out


def test_step1_default_model_is_prepared_once(launch_env, tmp_path):
    run = tmp_path / "run"
    out = launch_env("launch/step1_sft.sh", "--run_dir", str(run), "--dtype", "fp32").stdout
    prep, stage = commands(out)
    assert prep == [str(VENV_BIN / "rlhfkit"), "prepare-base", "--out", f"{run}/base"]
    stage, port = split_port(stage)
    assert stage == [threads(2), DEEPSPEED, "--num_gpus", "2", f"{REPO}/step1_sft/main.py",
                     "--model_name_or_path", f"{run}/base", "--data_path", DEFAULT_DATA,
                     "--output_dir", f"{run}/step1", "--zero_stage", "3", "--dtype", "fp32"]
    (run / "base").mkdir(parents=True)
    (run / "base" / "rlhfkit.json").write_text("{}")
    out = launch_env("launch/step1_sft.sh", "--run_dir", str(run)).stdout
    assert "prepare-base" not in out and len(commands(out)) == 1


@pytest.mark.parametrize("script,program,default_out", [
    ("launch/step2_reward.sh", "step2_reward/main.py", "step2"),
    ("launch/step2_dpo.sh", "step2_dpo/main.py", "step2_dpo"),
])
def test_step2_flags(launch_env, tmp_path, script, program, default_out):
    out = launch_env(script, "--model", "/r/step1", "--data", "d.jsonl", "--output", "/r/out", "--beta", "0.1",
                     "--data_split", "2,4,4", MASTER_PORT="29602").stdout
    assert one_stage(out) == [
        threads(2), DEEPSPEED, "--num_gpus", "2", "--master_port", "29602", f"{REPO}/{program}",
        "--model_name_or_path", "/r/step1", "--data_path", "d.jsonl", "--output_dir", "/r/out",
        "--zero_stage", "3", "--dtype", "bf16", "--beta", "0.1", "--data_split", "2,4,4"]
    # defaults chain through the run directory: RUN_DIR/step1 -> RUN_DIR/<this step>
    cmd = one_stage(launch_env(script, "--run_dir", "/r").stdout)
    assert cmd[cmd.index("--model_name_or_path") + 1] == "/r/step1"
    assert cmd[cmd.index("--output_dir") + 1] == f"/r/{default_out}"


def test_step3_flags(launch_env):
    out = launch_env("launch/step3_ppo.sh", "--actor", "/r/step1", "--critic", "/r/step2", "--data", "p.jsonl",
                     "--output", "/r/step3", "--algo", "grpo", "--actor_zero_stage", "2", "--critic_zero_stage", "3",
                     "--max_answer_seq_len", "64", "--offload_reference_model", MASTER_PORT="29603").stdout
    assert one_stage(out) == [
        threads(2), DEEPSPEED, "--num_gpus", "2", "--master_port", "29603", f"{REPO}/step3_ppo/main.py",
        "--actor_model_name_or_path", "/r/step1", "--critic_model_name_or_path", "/r/step2", "--data_path", "p.jsonl",
        "--output_dir", "/r/step3", "--algo", "grpo", "--actor_zero_stage", "2", "--critic_zero_stage", "3",
        "--dtype", "bf16", "--max_answer_seq_len", "64", "--offload_reference_model"]
    cmd = one_stage(launch_env("launch/step3_ppo.sh", "--run_dir", "/r").stdout)
    assert [cmd[cmd.index(f) + 1] for f in ("--actor_model_name_or_path", "--critic_model_name_or_path", "--output_dir",
                                            "--algo", "--actor_zero_stage", "--critic_zero_stage")] == \
        ["/r/step1", "/r/step2", "/r/step3", "ppo", "3", "3"]


def test_missing_value_and_help(launch_env):
    proc = launch_env("launch/step1_sft.sh", "--model", check=False)
    assert proc.returncode == 2 and "--model needs a value" in proc.stderr
    proc = launch_env("launch/step3_ppo.sh", "--help")
    assert "--actor_model_name_or_path" in proc.stdout and commands(proc.stdout) == []


# ---------------------------------------------------------------------------------------------
# topology: CPU threads, GPUs, hostfile, per-node (--no_ssh) mode


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_cpu_threads_per_rank(launch_env, ranks):
    cmd = one_stage(launch_env("launch/step1_sft.sh", "--model", "m", NUM_GPUS=str(ranks)).stdout)
    assert cmd[:4] == [threads(ranks), DEEPSPEED, "--num_gpus", str(ranks)]
    assert cmd[cmd.index("--dtype") + 1] == "bf16"  # bf16 stays on CPU


def test_cpu_ranks_and_given_threads(launch_env):
    cmd = one_stage(launch_env("launch/step1_sft.sh", "--model", "m", NUM_RANKS="4").stdout)
    assert cmd[:4] == [threads(4), DEEPSPEED, "--num_gpus", "4"]
    cmd = one_stage(launch_env("launch/step1_sft.sh", "--model", "m", OMP_NUM_THREADS="7").stdout)
    assert cmd[:3] == [DEEPSPEED, "--num_gpus", "2"]  # the user's OMP_NUM_THREADS is kept


def test_gpus_detected(launch_env):
    cmd = one_stage(launch_env("launch/step1_sft.sh", "--model", "m", gpus=4, MASTER_PORT="29604").stdout)
    assert cmd[:6] == [DEEPSPEED, "--num_gpus", "4", "--master_port", "29604", f"{REPO}/step1_sft/main.py"]
    cmd = one_stage(launch_env("launch/step1_sft.sh", "--model", "m", "--num_gpus", "2", gpus=4).stdout)
    assert cmd[:3] == [DEEPSPEED, "--num_gpus", "2"]
    # deepspeed --num_gpus would ignore CUDA_VISIBLE_DEVICES: the launcher passes it as --include
    cmd = one_stage(launch_env("launch/step1_sft.sh", "--model", "m", gpus=4, CUDA_VISIBLE_DEVICES="1,3").stdout)
    assert cmd[:3] == [DEEPSPEED, "--include", "localhost:1,3"]
    # RLHFKIT_CPU=1: CPU ranks even where GPUs exist
    cmd = one_stage(launch_env("launch/step1_sft.sh", "--model", "m", gpus=4, RLHFKIT_CPU="1").stdout)
    assert cmd[:4] == [threads(2), DEEPSPEED, "--num_gpus", "2"]


def test_hostfile(launch_env, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# nodes\nworker-0 slots=8\nworker-1 slots=8\n")
    cmd = one_stage(launch_env("launch/step2_reward.sh", "--model", "m", gpus=8, HOSTFILE=str(hostfile)).stdout)
    assert cmd[:6] == [DEEPSPEED, "--hostfile", str(hostfile), "--master_port", "29500", f"{REPO}/step2_reward/main.py"]
    cmd = one_stage(launch_env("launch/step2_reward.sh", "--model", "m", "--hostfile", str(hostfile), "--num_nodes", "1",
                               "--master_addr", "10.0.0.1", gpus=8, NUM_GPUS="4", MASTER_PORT="29611",
                               DEEPSPEED_ARGS="--launcher openmpi").stdout)
    assert cmd[:14] == [DEEPSPEED, "--hostfile", str(hostfile), "--num_nodes", "1", "--num_gpus", "4",
                        "--master_addr", "10.0.0.1", "--master_port", "29611", "--launcher", "openmpi",
                        f"{REPO}/step2_reward/main.py"]
    proc = launch_env("launch/step2_reward.sh", "--model", "m", HOSTFILE=str(tmp_path / "nope"), check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_no_ssh_per_node(launch_env, tmp_path):
    out = launch_env("launch/step3_ppo.sh", gpus=4, NO_SSH="1", NODE_RANK="1", MASTER_ADDR="10.0.0.1",
                     NUM_NODES="2").stdout
    cmd = one_stage(out)
    hostfile = tmp_path / f"rlhfkit-{os.getuid()}-hostfile-2x4"
    assert cmd[:16] == [DEEPSPEED, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", "1",
                        "--master_addr", "10.0.0.1", "--num_nodes", "2", "--num_gpus", "4", "--master_port", "29500",
                        f"{REPO}/step3_ppo/main.py", "--actor_model_name_or_path"]
    assert hostfile.read_text() == "node0 slots=4\nnode1 slots=4\n"
    # options instead of variables, a given hostfile, CPU ranks
    given = tmp_path / "hosts"
    given.write_text("a slots=1\nb slots=1\n")
    cmd = one_stage(launch_env("launch/step1_sft.sh", "--model", "m", "--no_ssh", "--node_rank", "0", "--master_addr",
                               "127.0.0.1", "--hostfile", str(given), "--num_gpus", "1", "--master_port", "29612").stdout)
    assert cmd[:14] == [threads(1), DEEPSPEED, "--hostfile", str(given), "--no_ssh", "--node_rank", "0",
                        "--master_addr", "127.0.0.1", "--num_gpus", "1", "--master_port", "29612",
                        f"{REPO}/step1_sft/main.py"]
    for missing in ("NODE_RANK", "MASTER_ADDR"):
        env = dict(NO_SSH="1", NODE_RANK="0", MASTER_ADDR="x", NUM_NODES="2")
        del env[missing]
        proc = launch_env("launch/step1_sft.sh", "--model", "m", check=False, **env)
        assert proc.returncode == 2 and missing in proc.stderr
    proc = launch_env("launch/step1_sft.sh", "--model", "m", check=False, NO_SSH="1", NODE_RANK="0", MASTER_ADDR="x")
    assert proc.returncode == 2 and "NUM_NODES" in proc.stderr


# ---------------------------------------------------------------------------------------------
# pipeline, smoke, examples


def test_pipeline_tiny(launch_env, tmp_path):
    run = tmp_path / "run"
    out = launch_env("launch/cpu_smoke.sh", "--out", str(run), "--step1_args", "--lora_dim 8", gpus=2).stdout
    prep, s1, s2, s3 = commands(out)
    assert prep[1:] == ["prepare-base", "--out", f"{run}/base"]
    for cmd, program in ((s1, "step1_sft"), (s2, "step2_reward"), (s3, "step3_ppo")):
        assert cmd[:4] == [threads(2), DEEPSPEED, "--num_gpus", "2"]  # CPU, 2 ranks, even with GPUs
        assert cmd[6] == f"{REPO}/{program}/main.py"
        assert cmd[cmd.index("--data_split") + 1] == "2,4,4"
        assert cmd[cmd.index("--data_path") + 1] == DEFAULT_DATA
    flag = lambda cmd, f: cmd[cmd.index(f) + 1]  # noqa: E731
    assert flag(s1, "--model_name_or_path") == f"{run}/base" and flag(s1, "--output_dir") == f"{run}/step1"
    assert flag(s1, "--max_steps") == "4" and flag(s1, "--lora_dim") == "8"
    assert flag(s2, "--model_name_or_path") == f"{run}/step1" and flag(s2, "--output_dir") == f"{run}/step2"
    assert "--lora_dim" not in s2 and "--lora_dim" not in s3
    assert flag(s3, "--actor_model_name_or_path") == f"{run}/step1"
    assert flag(s3, "--critic_model_name_or_path") == f"{run}/step2"
    assert flag(s3, "--output_dir") == f"{run}/step3" and flag(s3, "--algo") == "ppo"
    assert flag(s3, "--max_eval_samples") == "8" and flag(s3, "--eval_n_samples_per_prompt") == "2"  # a smoke-sized evaluation
    assert f"actor = {run}/step3/actor" in out

    # resume: finished stages are skipped
    for d in ("base", "step1", "step2/"):
        (run / d).mkdir(parents=True, exist_ok=True)
        (run / d / "rlhfkit.json").write_text("{}")
    out = launch_env("launch/pipeline.sh", "--out", str(run), "--size", "tiny", "--algo", "grpo").stdout
    (s3,) = commands(out)
    assert flag(s3, "--algo") == "grpo" and "skipping" in out


def test_pipeline_presets_and_errors(launch_env, tmp_path):
    out = launch_env("launch/pipeline.sh", "--out", str(tmp_path / "s"), "--data", "x.jsonl").stdout
    _, s1, s2, s3 = commands(out)
    flag = lambda cmd, f: cmd[cmd.index(f) + 1]  # noqa: E731
    assert [flag(s1, f) for f in ("--max_steps", "--per_device_train_batch_size", "--max_seq_len")] == ["24", "4", "256"]
    assert "--max_steps" not in s2 and "--fit_head_only" in s2 and flag(s2, "--eval_fraction") == "0.2"
    assert [flag(s3, f) for f in ("--max_steps", "--per_device_generation_batch_size", "--max_prompt_seq_len",
                                  "--max_answer_seq_len", "--actor_learning_rate", "--eval_fraction")] == [
        "20", "4", "96", "64", "1e-5", "0.2"]
    assert flag(s3, "--eval_n_samples_per_prompt") == "3"
    assert "--normalize_reward" in s3 and all(flag(s, "--data_split") == "2,6,2" for s in (s1, s2, s3))
    assert "rlhfkit eval (win rates of the actor over step 1) is not run by the small preset" in out
    assert flag(s3, "--data_path") == "x.jsonl"
    _, s1, _, _ = commands(launch_env("launch/pipeline.sh", "--out", str(tmp_path / "f"), "--size", "full").stdout)
    assert "--max_steps" not in s1
    proc = launch_env("launch/pipeline.sh", "--size", "huge", "--out", str(tmp_path / "h"), check=False)
    assert proc.returncode == 2 and "tiny, small, quality or full" in proc.stderr
    proc = launch_env("launch/pipeline.sh", "--bogus", "1", "--out", str(tmp_path / "b"), check=False)
    assert proc.returncode == 2 and "unknown argument" in proc.stderr


def test_pipeline_quality_trains_a_judge_on_a_share_no_other_stage_trains_on(launch_env, tmp_path):
    """--size quality: SFT, proxy and step 3 split 4,4,2; the judge starts from the base model on 0,4,6's phase 2
    (the same rows as SFT's phase 1, never the proxy's or step 3's); step 3 and rlhfkit eval are scored by it."""
    run = tmp_path / "q"
    out = launch_env("launch/pipeline.sh", "--out", str(run), "--size", "quality").stdout
    _, s1, proxy, judge, s3 = commands(out)
    flag = lambda cmd, f: cmd[cmd.index(f) + 1]  # noqa: E731
    assert [flag(c, "--data_split") for c in (s1, proxy, judge, s3)] == ["4,4,2", "4,4,2", "0,4,6", "4,4,2"]
    assert flag(judge, "--model_name_or_path") == str(run / "base") and flag(proxy, "--model_name_or_path") == str(run / "step1")
    assert flag(judge, "--output_dir") == str(run / "judge") and "--fit_head_only" in judge
    assert flag(s3, "--judge") == str(run / "judge") and flag(s3, "--num_train_epochs") == "3" and flag(s3, "--max_steps") == "96"
    assert flag(s3, "--max_eval_samples") == "128" and flag(proxy, "--eval_fraction") == "0.34"
    assert flag(s1, "--eval_fraction") == "0.3" and "--max_eval_samples" not in s1  # SFT's held-out rows stay held out
    ev = next(shlex.split(line[len("[launch] "):]) for line in out.splitlines() if " eval --actor " in line)
    assert flag(ev, "--judge") == str(run / "judge") and flag(ev, "--n") == "128" and flag(ev, "--n_samples_per_prompt") == "4"
    assert json.loads((run / "pipeline.json").read_text()) == {"size": "quality", "data_split": "4,4,2"}


def test_rule_rewards_tasks(launch_env, tmp_path):
    flag = lambda cmd, f: cmd[cmd.index(f) + 1]  # noqa: E731
    out = launch_env("launch/rule_rewards.sh", "--out", str(tmp_path / "g"), "--step3_args", "--seed 7").stdout
    base, grpo = commands(out)
    assert base[1:] == ["prepare-base", "--out", str(tmp_path / "g" / "base")]
    assert flag(grpo, "--algo") == "grpo" and flag(grpo, "--reward_fn") == "gsm8k"
    assert flag(grpo, "--data_path").endswith("shared/data/gsm8k/test_first1000.jsonl")
    assert flag(grpo, "--actor_model_name_or_path") == str(tmp_path / "g" / "base") and "--critic_model_name_or_path" not in grpo
    assert [flag(grpo, f) for f in ("--max_steps", "--max_answer_seq_len", "--max_eval_samples", "--seed")] == ["40", "192", "256", "7"]
    out = launch_env("launch/rule_rewards.sh", "--task", "arithmetic", "--out", str(tmp_path / "a"), "--model", "m",
                     "--steps", "3").stdout
    make, grpo = commands(out)
    data = str(tmp_path / "a" / "data" / "arithmetic-easy.jsonl")
    assert make[1:] == ["make-arithmetic", "--out", data, "--n", "2000", "--seed", "0", "--level", "easy"]
    assert flag(grpo, "--data_path") == data and flag(grpo, "--actor_model_name_or_path") == "m"
    assert flag(grpo, "--max_steps") == "3" and flag(grpo, "--max_answer_seq_len") == "96"
    assert flag(grpo, "--prompt_suffix") == 'Show the calculation in one line, then the final answer after "####".'
    assert "--eval_greedy" in grpo and flag(grpo, "--temperature") == "0.7"
    proc = launch_env("launch/rule_rewards.sh", "--task", "chess", "--out", str(tmp_path / "c"), check=False)
    assert proc.returncode == 2 and "use gsm8k or arithmetic" in proc.stderr


def test_topology_examples(launch_env, tmp_path):
    def stages(script, *args, **env):
        out = launch_env(script, str(tmp_path / Path(script).parent.name), *args, **env).stdout
        return [c for c in commands(out) if "prepare-base" not in c]

    single = stages("launch/single_gpu/run_135m.sh", gpus=8)
    assert len(single) == 3 and all(c[:3] == [DEEPSPEED, "--num_gpus", "1"] for c in single)
    assert single[0][single[0].index("--zero_stage") + 1] == "0"
    node = stages("launch/single_node/run_135m.sh", gpus=8)
    assert len(node) == 3 and all(c[:3] == [DEEPSPEED, "--num_gpus", "8"] for c in node)
    assert node[2][node[2].index("--actor_zero_stage") + 1] == "3"
    multi = stages("launch/multi_node/run_135m.sh", gpus=8)
    assert len(multi) == 3 and all(c[:3] == [DEEPSPEED, "--hostfile", str(LAUNCH / "multi_node" / "hostfile")]
                                   for c in multi)
    per_node = stages("launch/multi_node/run_135m_no_ssh.sh", gpus=8, NODE_RANK="1", MASTER_ADDR="10.0.0.1",
                      NUM_NODES="2")
    assert len(per_node) == 3
    assert all(c[3:8] == ["--no_ssh", "--node_rank", "1", "--master_addr", "10.0.0.1"] for c in per_node)


@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", str(REPO / script)], check=True)
    if shutil.which("shellcheck"):
        proc = subprocess.run(["shellcheck", "-x", script], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout


# ---------------------------------------------------------------------------------------------
# a real two-node run on localhost: two per-node launchers (--no_ssh), one rank each


@pytest.mark.distributed
def test_two_nodes_no_ssh(tiny_dir, tmp_path):
    require_data(HH)
    out = tmp_path / "sft"
    port = str(free_port())
    procs = []
    for node in (0, 1):
        env = env_for_ranks(1)
        for k in LAUNCHER_VARS:
            env.pop(k, None)
        env.update(OMP_NUM_THREADS="1", RLHFKIT_NO_SETUP="1", VENV=str(VENV_BIN.parent), TMPDIR=str(tmp_path),
                   NO_SSH="1", NUM_NODES="2", NUM_GPUS="1", NODE_RANK=str(node), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port)
        cmd = ["bash", str(LAUNCH / "step1_sft.sh"), "--model", str(tiny_dir), "--data", str(HH), "--output", str(out),
               "--max_steps", "2", "--max_seq_len", "64", "--dtype", "fp32", "--zero_stage", "3",
               "--per_device_train_batch_size", "2", "--max_eval_samples", "4"]
        log = open(tmp_path / f"node{node}.txt", "w")
        procs.append((subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=600))
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            raise
        finally:
            log.close()
    outputs = [(tmp_path / f"node{n}.txt").read_text() for n in (0, 1)]
    assert codes == [0, 0], "\n\n".join(o[-4000:] for o in outputs)
    for node, text in enumerate(outputs):
        cmd = one_stage(text)
        assert cmd[cmd.index("--node_rank") + 1] == str(node) and "--no_ssh" in cmd
    assert "global batch 4 (2 x 2 ranks" in outputs[0]

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 2
    assert (out / "rlhfkit.json").exists()
    assert "step1_sft/main.py" in (out / "logs" / "train.log").read_text()
    assert (out / "logs" / "train.node1.log").exists()
