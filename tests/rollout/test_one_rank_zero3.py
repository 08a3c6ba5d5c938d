"""Rollouts on one rank of a ZeRO-3 engine, as a single-GPU user with ZeRO-3 runs them."""

from __future__ import annotations

import json

from testutils import run_program


def test_one_rank_zero3_backends_give_plain_generate_tokens(tiny_dir, tmp_path):
    out = tmp_path / "one_rank_zero3.json"
    run_program("tests/rollout/one_rank_zero3_worker.py", ["--model", str(tiny_dir), "--out", str(out)], nprocs=1, timeout=600)
    got = json.loads(out.read_text())
    assert got["partitioned"], "the engine's parameters are not ZeRO-3 partitioned: the test would prove nothing"
    for backend in ("hf-synced", "hf"):
        width = len(got[backend][0])
        assert width > 0 and [row[:width] for row in got["want"]] == got[backend], (backend, got)
