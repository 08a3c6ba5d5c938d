"""rlhfkit.zero3_grad_buffer: ZeRO-3's fp32 gradients in one kept buffer give DeepSpeed's own bits (2 ranks)."""

import json

from testutils import run_program


def test_kept_fp32_gradient_buffer_trains_two_engines_as_deepspeed_does(tiny_dir, tmp_path):
    out = tmp_path / "grad_buffer.json"
    run_program("tests/grad_buffer_worker.py", ["--model", str(tiny_dir), "--out", str(out)], nprocs=2, timeout=600)
    got = json.loads(out.read_text())
    assert got["installed"]
    # one fp32 buffer for both engines (of different sizes, each with sub-groups of several sizes), as large as
    # the largest sub-group's fp32 partition
    actor, critic = got["partition_numel"]
    assert sum(actor) != sum(critic) and len(set(actor + critic)) > 1, got
    assert got["kept_numel"] == {"torch.float32": max(actor + critic)}, got
    # the actor and the critic, their steps interleaved, end with DeepSpeed's weights bit for bit
    assert got["losses"]["kept"] == got["losses"]["deepspeed"]
    assert got["both_moved"] == [True, True] and got["weights_equal"]


def test_kept_buffer_is_off_on_request(monkeypatch):
    from rlhfkit import zero3_grad_buffer

    monkeypatch.setenv("RLHFKIT_KEEP_FREED_MEMORY", "0")
    assert zero3_grad_buffer.install() is False
