"""`rlhfkit best-of-n`: the pick of the best of the first N samples and the per-N table, by hand; the
command on the tiny model end to end."""

import json

import pytest

from rlhfkit.best_of_n import best_of_n_table, pick_best


def test_pick_best_of_the_first_n_by_hand():
    proxy = [[0.1, 0.5, 0.3, 0.9],
             [0.7, 0.2, 0.7, 0.1]]  # a tie: the first wins
    assert pick_best(proxy, 1) == [0, 0]
    assert pick_best(proxy, 2) == [1, 0]
    assert pick_best(proxy, 3) == [1, 0]
    assert pick_best(proxy, 4) == [3, 0]


def test_table_by_hand():
    proxy = [[0.1, 0.5, 0.3, 0.9], [0.7, 0.2, 0.8, 0.1]]
    judge = [[1.0, 2.0, 0.0, 4.0], [3.0, 0.0, 5.0, 1.0]]
    lengths = [[10, 20, 30, 40], [5, 6, 7, 8]]
    rows = best_of_n_table(proxy, {"j": judge}, lengths, [1, 4])
    n1, n4 = rows
    assert n1["proxy"]["mean"] == pytest.approx((0.1 + 0.7) / 2) and n1["length"]["mean"] == (10 + 5) / 2
    assert n1["judges"]["j"]["score"]["mean"] == (1.0 + 3.0) / 2 and n1["judges"]["j"]["gain_over_n1"]["mean"] == 0
    # N=4 picks sample 3 of prompt 1 (0.9) and sample 2 of prompt 2 (0.8)
    assert n4["proxy"]["mean"] == pytest.approx((0.9 + 0.8) / 2) and n4["length"]["mean"] == (40 + 7) / 2
    assert n4["judges"]["j"]["score"]["mean"] == (4.0 + 5.0) / 2
    gain = n4["judges"]["j"]["gain_over_n1"]
    assert gain["mean"] == ((4 - 1) + (5 - 3)) / 2 and gain["n"] == 2  # paired by prompt
    assert gain["ci_low"] < gain["mean"] < gain["ci_high"]


def test_best_of_n_command_on_the_tiny_model(tiny_dir, tokenizer, tmp_path):
    import torch

    from rlhfkit.checkpoint import build_manifest, export_model
    from rlhfkit.cli import main
    from rlhfkit.models import load_model

    dirs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        rm = load_model(str(tiny_dir), "reward", dtype="fp32", pad_token_id=tokenizer.pad_token_id)
        rm.score.weight.data.normal_(0, 1.0)
        dirs.append(tmp_path / f"rm{seed}")
        export_model(rm, tokenizer, dirs[-1], build_manifest(stage="reward", config={}, tokenizer=tokenizer))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me about {w}."}) + "\n" for w in ("cats", "rain", "tea")))
    main(["best-of-n", "--policy", str(tiny_dir), "--reward_model", str(dirs[0]), "--judge", str(dirs[1]),
          "--prompts", str(prompts), "--n", "1,2,4", "--max_new_tokens", "6", "--out", str(tmp_path / "bon")])
    rows = json.loads((tmp_path / "bon" / "results.json").read_text())["rows"]
    assert [r["n"] for r in rows] == [1, 2, 4] and rows[0]["proxy"]["n"] == 3
    proxy = [r["proxy"]["mean"] for r in rows]
    assert proxy[0] <= proxy[1] <= proxy[2]  # the proxy's own score of its pick can only rise with N (nested samples)
    assert rows[0]["judges"][str(dirs[1])]["gain_over_n1"]["mean"] == 0
