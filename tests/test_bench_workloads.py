"""bench/workloads.py: the speed benches' prompts have one length whichever rows a revision draws.

The bench writes hh-rlhf text cut to a fixed number of prompt tokens; these tests read that file back
the way step 3 does (its data loader, split and prompt tokenisation) and count the tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rlhfkit.data import load_phase_data
from rlhfkit.data.tokenize import encode_prompt, tokenize_prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from workloads import exact_length_prompts, exact_prompt  # noqa: E402


@pytest.mark.parametrize("length", [64, 128, 1024])
def test_every_prompt_has_the_length_step3_sees(shared_data, tokenizer, tmp_path, length):
    hh = str(shared_data / "hh-rlhf-harmless-base" / "pairs.jsonl.gz")
    path = exact_length_prompts(hh, tokenizer, str(tmp_path / "prompts.jsonl"), rows=40, length=length)
    train, held_out, _ = load_phase_data(path, phase=3, need="prompts", data_split="2,4,4", eval_fraction=0.1)
    features, report = tokenize_prompts(train + held_out, tokenizer, length)
    assert len(train) + len(held_out) == 16  # 40% of 40 rows: step 3's share of the bench's split
    assert report.kept == 16 and report.prompt_truncated == 0 and not report.dropped
    assert {len(f["prompt_ids"]) for f in features} == {length}


def test_the_prompts_are_real_text_as_one_user_turn(shared_data, tokenizer, tmp_path):
    hh = str(shared_data / "hh-rlhf-harmless-base" / "pairs.jsonl.gz")
    path = exact_length_prompts(hh, tokenizer, str(tmp_path / "prompts.jsonl"), rows=8, length=128)
    rows, _, _ = load_phase_data(path, phase=3, need="prompts", data_split="0,0,1", eval_fraction=0.0)
    assert len({str(r.prompt) for r in rows}) == 8  # all different
    for r in rows:
        assert [m["role"] for m in r.prompt] == ["user"]  # not parsed into hh turns
        assert "User:" in r.prompt[0]["content"] and "Assistant:" in r.prompt[0]["content"]


def test_a_text_too_short_for_the_length_gives_none(tokenizer):
    overhead = len(encode_prompt(tokenizer, [{"role": "user", "content": ""}]))
    assert exact_prompt(tokenizer, "Hello there.", overhead + 50) is None
    words = " ".join(["word"] * 200)
    assert len(encode_prompt(tokenizer, [{"role": "user", "content": exact_prompt(tokenizer, words, overhead + 50)}])) == overhead + 50
