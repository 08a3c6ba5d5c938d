"""Experiment trackers behind ``--report_to``: wandb and mlflow (optional extras, imported only when named).

- **wandb** (``pip install rlhfkit[wandb]``): ``wandb.init`` in ``<output_dir>/logs``, project
  ``$WANDB_PROJECT`` or "rlhfkit". Offline unless ``WANDB_MODE`` says otherwise or ``WANDB_API_KEY`` is
  set; an offline run is synced later with ``wandb sync <output_dir>/logs/wandb/offline-run-*``.
- **mlflow** (``pip install rlhfkit[mlflow]``, mlflow-skinny is enough): ``$MLFLOW_TRACKING_URI``, or a
  local file store in ``<output_dir>/logs/mlruns``; experiment ``$MLFLOW_EXPERIMENT_NAME`` or "rlhfkit".

Each tracker gets the run's config as its parameters when it starts and, when it closes, the
checkpoint manifests the run wrote (``manifest/...``). Its run id goes into the training state, so a
resumed run continues the same tracker run. Only rank 0 tracks.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any, Optional

from rlhfkit.errors import ConfigError

REPORT_TO = ("jsonl", "tensorboard", "wandb", "mlflow")


def parse_report_to(value: Any, enable_tensorboard: bool = False) -> list[str]:
    """``"tensorboard,jsonl"`` (or a list) -> the names, checked; jsonl is always on (``rlhfkit report`` reads
    it), and DeepSpeed-Chat's ``--enable_tensorboard`` adds tensorboard."""
    names = [n.strip() for n in (value.split(",") if isinstance(value, str) else value) if n.strip()]
    unknown = [n for n in names if n not in REPORT_TO + ("none",)]
    if unknown:
        raise ConfigError(f"--report_to {','.join(unknown)}: choose from {', '.join(REPORT_TO)} (or none)")
    names = [n for n in names if n != "none"]
    extra = ["tensorboard"] if enable_tensorboard else []
    return list(dict.fromkeys(["jsonl", *names, *extra]))


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    """Nested dicts -> {"a/b": "value"} with values as strings (at most 500 characters, mlflow's limit)."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        else:
            out[key] = str(v)[:500]
    return out


def safe_key(key: str) -> str:
    """mlflow accepts letters, digits, _ - . / and spaces in names; anything else becomes '_'."""
    return re.sub(r"[^\w\-./ ]", "_", key)


class WandbTracker:
    def __init__(self, log_dir: str, name: str, config: dict, run_id: Optional[str] = None):
        try:
            import wandb
        except ImportError:
            raise ConfigError("--report_to wandb needs wandb: pip install 'rlhfkit[wandb]'") from None
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "rlhfkit"), name=name, dir=log_dir, mode=mode,
                              config=config, id=run_id, resume="allow" if run_id else None)
        self.id = self.run.id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self, manifests: dict) -> None:
        if manifests:
            self.run.config.update({"manifest": manifests}, allow_val_change=True)
        self.run.finish()


class MlflowTracker:
    def __init__(self, log_dir: str, name: str, config: dict, run_id: Optional[str] = None):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ConfigError("--report_to mlflow needs mlflow: pip install 'rlhfkit[mlflow]'") from None
        uri = os.environ.get("MLFLOW_TRACKING_URI") or Path(log_dir, "mlruns").absolute().as_uri()
        if uri.startswith("file:"):  # mlflow 3 keeps the file store working only when asked
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(uri)
        self.id = run_id
        if run_id is None:
            experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "rlhfkit")
            found = self.client.get_experiment_by_name(experiment)
            exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
            self.id = self.client.create_run(exp_id, run_name=name).info.run_id
            self.log_params(config)
        else:
            self.client.update_run(run_id, status="RUNNING")

    def log_params(self, params: dict, prefix: str = "") -> None:
        """Parameters are immutable in mlflow: those a continued run already has keep their first value."""
        from mlflow.entities import Param

        have = self.client.get_run(self.id).data.params
        items = [Param(safe_key(k), v) for k, v in flatten(params, prefix).items() if safe_key(k) not in have]
        for i in range(0, len(items), 100):  # mlflow takes at most 100 parameters a batch
            self.client.log_batch(self.id, params=items[i:i + 100])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[Metric(safe_key(k), v, now, step) for k, v in scalars.items()])

    def close(self, manifests: dict) -> None:
        if manifests:
            self.log_params(manifests, "manifest/")
            self.client.log_dict(self.id, manifests, "manifests.json")  # the latest ones, whole
        self.client.set_terminated(self.id)


TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def run_manifests(output_dir: str) -> dict:
    """The checkpoint manifests a run wrote: ``rlhfkit.json`` in its output directory and its subdirectories
    (step 3: actor/, critic/), without the per-file hashes."""
    import json

    found = {}
    for path in [Path(output_dir, "rlhfkit.json"), *sorted(Path(output_dir).glob("*/rlhfkit.json"))]:
        if path.is_file():
            manifest = json.loads(path.read_text())
            manifest.pop("files", None)
            found[path.parent.name if path.parent != Path(output_dir) else "model"] = manifest
    return found
