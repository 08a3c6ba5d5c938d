"""rlhfkit.rollout.shared_decode: the ranks of one host share their decode steps (each computes a share of
every product's columns for every rank's rows) and get the tokens of their own decode (2 ranks)."""

from __future__ import annotations

import json
import warnings

import pytest

from testutils import run_program


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("shared_decode") / "shared_decode.json"
    run_program("tests/rollout/shared_decode_worker.py", ["--out", str(out)], nprocs=2, timeout=600)
    return json.loads(out.read_text())


def test_shared_decode_steps_give_each_rank_its_own_tokens(ranks):
    for got in ranks:
        d = got["decoder"]
        assert d["group"], got
        for name in ("greedy", "sampled"):
            # the same tokens and widths, greedy and sampled (each rank's own random numbers), and nothing
            # drawn after a rank's rows have all ended while the other rank's still decode
            assert d[name]["equal"] and d[name]["same_random_stream_after"], (name, d)
        assert d["greedy_most_rows"], d  # 32 rows in all
    # the case the sharing must handle: one rank's rows all end before the other's
    for name in ("greedy", "sampled"):
        widths = [got["decoder"][name]["width"] for got in ranks]
        assert len(set(widths)) == 2 and any(got["decoder"][name]["ended"] for got in ranks), (name, ranks)


def test_shared_decode_logits_match_the_rank_s_own_step(ranks):
    for got in ranks:
        d = got["decoder"]
        assert d["logits_max_diff"] <= 1e-2 * d["logits_scale"], d
        if not d["logits_bitwise"]:  # where oneDNN's products depend on the number of rows
            warnings.warn(f"shared decode logits differ from the rank's own in rounding: {d['logits_max_diff']}")


def test_hf_backend_shares_zero3_decode_steps_only_when_every_rank_can(ranks):
    for got in ranks:
        b = got["backend"]
        # one exchange to agree, one a step to hand over the tokens (10 steps), and five a layer (2 layers) and one
        # for the logits in each of the 9 decode steps after the prefill
        assert b["exchanges"] == 1 + 10 + 9 * (2 * 5 + 1) and b["equals_generate"], b
        # unequal row counts, more than 32 rows in all, or weights below the bound (this tiny model's, at the
        # module's own bound): the ranks agree (one exchange) not to share
        assert b["unequal_rows_exchanges"] == 1 and b["too_many_rows_exchanges"] == 1, b
        assert b["small_weights_exchanges"] == 1, b


def test_shared_decode_is_off_on_request(monkeypatch):
    from rlhfkit.errors import ConfigError
    from rlhfkit.rollout import shared_decode

    monkeypatch.setenv(shared_decode.ENV, "0")
    assert not shared_decode.wanted()
    monkeypatch.setenv(shared_decode.ENV, "maybe")
    with pytest.raises(ConfigError, match="RLHFKIT_SHARED_DECODE='maybe'"):
        shared_decode.wanted()
