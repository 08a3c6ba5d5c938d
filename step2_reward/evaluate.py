"""Evaluate or use a reward model in one process (no DeepSpeed); the same program as `rlhfkit score`.

    python step2_reward/evaluate.py --model out/step2                      # held-out pairs of the training run
    python step2_reward/evaluate.py --model out/step2 --data_path pairs.jsonl [--out scores.jsonl]
    python step2_reward/evaluate.py --model out/step2 --prompt "..." --response "..."
See rlhfkit/scoring.py for every flag.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

from rlhfkit.program import run_main  # noqa: E402
from rlhfkit.scoring import main  # noqa: E402

if __name__ == "__main__":
    run_main(main)
