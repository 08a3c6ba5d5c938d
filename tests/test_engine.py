"""The DeepSpeed training engine as ``rlhfkit.engines.build_engine`` builds it."""

from __future__ import annotations

import json


from testutils import run_program


def test_one_rank_zero0_skips_the_gradient_all_reduce_with_the_same_bits(tiny_dir, tmp_path):
    """One data-parallel rank at ZeRO-0: no all-reduce after backward, and two bf16 AdamW steps land on
    exactly the parameters that DeepSpeed's all-reduce path gives."""
    out = tmp_path / "engine.json"
    run_program("tests/engine_worker.py", ["--model", str(tiny_dir), "--out", str(out)], nprocs=1, timeout=600)
    got = json.loads(out.read_text())
    assert got["built_allreduce"] is False
    assert got["changed"], "the steps did not move the parameters: the comparison would prove nothing"
    assert got["same_bits"]
