"""ZeRO's all-gather and reduce-scatter through shared memory (rlhfkit.shm_collectives; 2 ranks, one host)."""

import json

import pytest

from testutils import run_program


def test_shm_collectives_match_hand_values_gloo_and_a_gloo_trained_engine(tiny_dir, tmp_path):
    out = tmp_path / "shm.json"
    run_program("tests/shm_worker.py", ["--model", str(tiny_dir), "--out", str(out)], nprocs=2, timeout=900)
    got = json.loads(out.read_text())
    if not got["available"]:
        pytest.skip("DeepSpeed's shared-memory all-reduce was not built on this host")
    assert got["installed"]
    for case in got["cases"]:
        # rank r's shard in slot r (also when it is already there: in place); each rank keeps the sum of its slice
        assert case["gather_hand"] and case["scatter_hand"], case
        # gloo's own all-gather / reduce-scatter on random values, bit for bit (rounding and the signs of zeros)
        assert case["gather_gloo"] and case["scatter_gloo"], case
        # fp32 and bf16 both take the shared-memory path, in several pieces for the largest size
        assert case["shm_calls"] == 5 and case["fallbacks"] == 0, case
    for case in got["coalesced"]:
        # ZeRO-3's averaged reduce-scatter of several gradients: DeepSpeed's own bits, the hand-computed mean
        assert case["ds"] and case["hand"] and case["lengths"], case
        assert case["shm_calls"] == 1 and case["fallbacks"] == 0, case
    # an async caller gets a finished handle; a strided input and an integer tensor go to gloo, correctly
    assert got["fallback"] == {"async_ok": True, "strided_ok": True, "ints_ok": True, "fallbacks": 2}
    # a ZeRO-3 engine gathers and reduces through shared memory and trains as it does through gloo
    assert got["engine_shm_calls"]["all_gather"] > 0
    assert got["engine_shm_calls"]["reduce_scatter"] > 0
    assert got["losses"]["shm"] == got["losses"]["gloo"]
    assert got["weights_moved"] and got["weights_equal"]


def test_shm_collectives_can_be_turned_off(tiny_dir, tmp_path):
    out = tmp_path / "off.json"
    run_program("tests/shm_worker.py", ["--model", str(tiny_dir), "--out", str(out)], nprocs=2, timeout=600,
                env_extra={"RLHFKIT_SHM_COLLECTIVES": "0"})
    assert json.loads(out.read_text())["installed"] is False


def test_a_peer_gone_mid_collective_ends_the_rank_with_the_collective_error(tiny_dir, tmp_path):
    """The ranks meet in DeepSpeed's shared-memory kernel, which waits for its peers without a timeout: the watchdog ends the rank
    (exit 3, the programs' one-line collective error) instead of leaving it spinning for good."""
    proc = run_program("tests/shm_worker.py", ["--model", str(tiny_dir), "--out", str(tmp_path / "x.json"), "--peer_dies"],
                       nprocs=2, timeout=120, check=False)
    if "collectives: ZeRO's all-gather" not in proc.stdout:
        pytest.skip("DeepSpeed's shared-memory all-reduce was not built on this host")
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert ("error: rank 0 of 2: a collective operation failed, so another rank died, was killed or stopped answering "
            "(timeout --dist_timeout_s); stopping. (shared-memory collective: peer process ") in proc.stderr, proc.stderr[-3000:]
