"""Rank-0 metrics: stdout, a JSONL file and TensorBoard, from one call."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Optional

from rlhfkit import distributed as dist


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.3e}"
        return f"{v:.4f}"
    return str(v)


class MetricsLogger:
    """``log(step, {"train/loss": 1.2, ...})`` writes one JSON line per call (``<dir>/metrics.jsonl``), and to
    the other ``--report_to`` trackers: TensorBoard scalars, wandb, mlflow (:mod:`rlhfkit.trackers`; they
    start at the first ``log``, continuing the run ids a resumed training state gave ``resume_trackers``);
    and (``echo=True``) a compact stdout line. Only rank 0 writes."""

    def __init__(self, log_dir: str, enable_tensorboard: bool = False, tensorboard_path: Optional[str] = None,
                 program: str = "", report_to: Any = None, config: Optional[dict] = None):
        from rlhfkit.trackers import parse_report_to

        self.enabled = dist.is_main()
        self.program = program
        self.log_dir = log_dir
        self.path = os.path.join(log_dir, "metrics.jsonl")
        self.report_to = parse_report_to(report_to if report_to is not None else "jsonl", enable_tensorboard)
        self.config = config or {}
        self.trackers: Optional[dict[str, Any]] = None  # name -> tracker, once started
        self.resume_ids: dict[str, str] = {}
        self.tb = None
        self.start = time.time()
        if not self.enabled:
            return
        os.makedirs(log_dir, exist_ok=True)
        if "tensorboard" in self.report_to:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(tensorboard_path or os.path.join(log_dir, "tensorboard"))

    def resume_trackers(self, ids: dict[str, str]) -> None:
        """Continue these tracker runs (name -> run id, from a training state) instead of starting new ones."""
        self.resume_ids = dict(ids or {})

    def tracker_ids(self) -> dict[str, str]:
        """name -> run id of the started trackers (kept in the training state)."""
        return {name: t.id for name, t in (self.trackers or {}).items()}

    def _start_trackers(self) -> dict[str, Any]:
        from rlhfkit.trackers import TRACKERS

        if self.trackers is None:
            self.trackers = {name: TRACKERS[name](self.log_dir, self.program, self.config, self.resume_ids.get(name))
                             for name in self.report_to if name in TRACKERS}
        return self.trackers

    def log(self, step: int, values: dict[str, Any], echo: bool = True, write=None) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if hasattr(v, "__float__") and not isinstance(v, (int, str)) else v) for k, v in values.items()}
        record = {"program": self.program, "step": step, "time_s": round(time.time() - self.start, 3), **clean}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=str) + "\n")
        scalars = {k: float(v) for k, v in clean.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        for tracker in self._start_trackers().values():
            tracker.log(step, scalars)
        if echo:
            line = f"[{self.program} step {step}] " + " ".join(f"{k}={_fmt(v)}" for k, v in clean.items())
            (write or print)(line)

    def close(self) -> None:
        """Close the trackers, giving them the checkpoint manifests the run wrote."""
        from rlhfkit.trackers import run_manifests

        if self.tb is not None:
            self.tb.close()
        if self.trackers:
            manifests = run_manifests(os.path.dirname(os.path.abspath(self.log_dir)))
            for tracker in self.trackers.values():
                tracker.close(manifests)


def read_metrics(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
