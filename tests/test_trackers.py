"""--report_to: the names by hand; a real step-1 run that reports to wandb (offline) and mlflow (a local file
store), is stopped after a saved state and resumed; both trackers' own readers (`wandb leet inspect`,
MlflowClient) open one run each, with every step's loss, the config as parameters and the manifest."""

import json
import subprocess

import pytest

from rlhfkit.errors import ConfigError
from rlhfkit.trackers import parse_report_to, safe_key
from test_step1_sft import memo_data, sft_args  # noqa: F401 - memo_data is a fixture
from testutils import VENV_BIN, env_for_ranks, run_program


def test_report_to_names():
    assert parse_report_to("tensorboard,jsonl") == ["jsonl", "tensorboard"]
    assert parse_report_to("none") == ["jsonl"]  # the metrics file is always written: rlhfkit report reads it
    assert parse_report_to("jsonl", enable_tensorboard=True) == ["jsonl", "tensorboard"]  # DeepSpeed-Chat's flag adds it
    assert parse_report_to(["wandb", "mlflow"]) == ["jsonl", "wandb", "mlflow"]
    with pytest.raises(ConfigError, match="--report_to comet: choose from"):
        parse_report_to("wandb,comet")
    assert safe_key("reward/fn/http://h:80/score") == "reward/fn/http_//h_80/score"


def test_wandb_and_mlflow_runs_continue_across_a_resume(tiny_dir, memo_data, tmp_path, monkeypatch):  # noqa: F811
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 reads a local file store only when asked

    out = tmp_path / "sft"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": ""}
    args = sft_args(tiny_dir, memo_data, out, "--zero_stage", "0", "--report_to", "jsonl,wandb,mlflow", "--save_interval", "2")
    run_program("step1_sft/main.py", [*args, "--max_steps", "2"], nprocs=0, env_extra=env)
    state = json.loads((out / "training_state" / "step_2" / "state.json").read_text())
    ids = state["trackers"]
    assert set(ids) == {"wandb", "mlflow"}
    run_program("step1_sft/main.py", [*args, "--max_steps", "4", "--resume", "auto"], nprocs=0, env_extra=env)

    runs = sorted((out / "logs" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(ids["wandb"]) for r in runs)  # both invocations: one wandb run id
    losses = {}
    for run in runs:
        inspect = subprocess.run([str(VENV_BIN / "wandb"), "leet", "inspect", "--json", str(next(run.glob("*.wandb")))],
                                 capture_output=True, text=True, check=True, env=env_for_ranks(1))
        for line in inspect.stdout.splitlines():
            record = json.loads(line)
            if record.get("type") == "history" and "train/loss" in record["history"]["item"]:
                losses[record["history"]["item"]["_step"]] = record["history"]["item"]["train/loss"]
    jsonl = {r["step"]: r["train/loss"] for r in map(json.loads, (out / "logs" / "metrics.jsonl").read_text().splitlines())
             if "train/loss" in r}
    assert losses == pytest.approx(jsonl) and sorted(losses) == [1, 2, 3, 4]
    summary = json.loads(subprocess.run([str(VENV_BIN / "wandb"), "leet", "inspect", "--summary", "--json", str(runs[-1])],
                                        capture_output=True, text=True, check=True, env=env_for_ranks(1)).stdout)
    assert summary["config"]["learning_rate"] == 3e-3 and summary["config"]["manifest"]["model"]["stage"] == "sft"

    client = MlflowClient((out / "logs" / "mlruns").absolute().as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("rlhfkit").experiment_id])
    assert run.info.run_id == ids["mlflow"] and run.info.status == "FINISHED"
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert history == pytest.approx(jsonl)
    assert run.data.params["learning_rate"] == "0.003" and run.data.params["manifest/model/stage"] == "sft"
