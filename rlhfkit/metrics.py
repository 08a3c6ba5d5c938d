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
    """``log(step, {"train/loss": 1.2, ...})`` writes one JSON line per call (``<dir>/metrics.jsonl``),
    TensorBoard scalars when enabled, and (``echo=True``) a compact stdout line. Only rank 0 writes."""

    def __init__(self, log_dir: str, enable_tensorboard: bool = False, tensorboard_path: Optional[str] = None,
                 program: str = ""):
        self.enabled = dist.is_main()
        self.program = program
        self.path = os.path.join(log_dir, "metrics.jsonl")
        self.tb = None
        self.start = time.time()
        if not self.enabled:
            return
        os.makedirs(log_dir, exist_ok=True)
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(tensorboard_path or os.path.join(log_dir, "tensorboard"))

    def log(self, step: int, values: dict[str, Any], echo: bool = True, write=None) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if hasattr(v, "__float__") and not isinstance(v, (int, str)) else v) for k, v in values.items()}
        record = {"program": self.program, "step": step, "time_s": round(time.time() - self.start, 3), **clean}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=str) + "\n")
        if self.tb is not None:
            for k, v in clean.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if echo:
            line = f"[{self.program} step {step}] " + " ".join(f"{k}={_fmt(v)}" for k, v in clean.items())
            (write or print)(line)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
