"""Tokenisation with the real SmolLM2 tokenizer (chat template, EOS <|im_end|>) and the collators."""

import pytest

from rlhfkit.data import (
    IGNORE_INDEX,
    Example,
    encode_prompt,
    encode_response,
    tokenize_by_source,
    tokenize_pairs,
    tokenize_prompts,
    tokenize_sft,
)

torch = pytest.importorskip("torch")
from rlhfkit.data.collate import collate_packed_pairs, collate_pairs, collate_prompts, collate_sft  # noqa: E402

LONG = " ".join(f"word{i}" for i in range(60))


def ex(prompt, chosen=None, rejected=None):
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return Example(messages, chosen, rejected, {"source": "test", "row": 0})


def test_encode_prompt_uses_chat_template(tokenizer):
    messages = [{"role": "user", "content": "Hi there"}]
    ids = encode_prompt(tokenizer, messages)
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert ids == tokenizer(text, add_special_tokens=False).input_ids


def test_encode_prompt_without_chat_template(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", None)
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert tokenizer.decode(encode_prompt(tokenizer, messages)) == "Human: a\n\nAssistant: b\n\nHuman: c\n\nAssistant:"


def test_encode_response_ends_with_eos(tokenizer):
    ids = encode_response(tokenizer, "Paris is the capital.")
    assert ids[-1] == tokenizer.eos_token_id and tokenizer.eos_token == "<|im_end|>"
    assert ids[:-1] == tokenizer("Paris is the capital.", add_special_tokens=False).input_ids
    assert tokenizer.eos_token_id not in ids[:-1]


def test_sft_labels_cover_response_and_eos_only(tokenizer):
    examples = [ex("What is the capital of France?", "Paris."), ex([
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"}], "4")]
    features, report = tokenize_sft(examples, tokenizer, max_seq_len=512)
    assert (report.examples, report.kept, report.prompt_truncated, report.response_truncated) == (2, 2, 0, 0)
    for e, f in zip(examples, features):
        prompt = encode_prompt(tokenizer, e.prompt)
        response = encode_response(tokenizer, e.chosen)
        assert f["input_ids"] == prompt + response
        assert f["labels"] == [IGNORE_INDEX] * len(prompt) + response
        assert f["labels"][-1] == f["input_ids"][-1] == tokenizer.eos_token_id
    assert tokenizer.decode([t for t in features[0]["labels"] if t != IGNORE_INDEX]) == "Paris.<|im_end|>"
    assert report.summary() == ("tokenised 2 examples: kept 2, prompt truncated 0, response truncated 0, "
                                "none dropped")


def test_sft_prompt_left_cut_keeps_whole_response(tokenizer):
    e = ex(LONG, "short answer")
    p, r = len(encode_prompt(tokenizer, e.prompt)), len(encode_response(tokenizer, e.chosen))
    L = p + r - 10  # 10 tokens too long; the prompt can give them (p - 10 >= L // 2)
    [f], report = tokenize_sft([e], tokenizer, L)
    assert len(f["input_ids"]) == L and report.prompt_truncated == 1 and report.response_truncated == 0
    assert f["input_ids"][:L - r] == encode_prompt(tokenizer, e.prompt)[10:]  # the prompt's left end went
    assert f["labels"] == [IGNORE_INDEX] * (p - 10) + encode_response(tokenizer, e.chosen)
    assert f["input_ids"][-1] == tokenizer.eos_token_id


def test_sft_response_right_cut_without_eos(tokenizer):
    e = ex(LONG, LONG)
    prompt, response = encode_prompt(tokenizer, e.prompt), encode_response(tokenizer, e.chosen)
    L = 64  # prompt keeps min(p, L // 2) = 32 tokens, the response the other 32
    [f], report = tokenize_sft([e], tokenizer, L)
    assert (report.prompt_truncated, report.response_truncated) == (1, 1)
    assert f["input_ids"] == prompt[-32:] + response[:32]
    assert f["labels"] == [IGNORE_INDEX] * 32 + response[:32]
    assert tokenizer.eos_token_id not in f["input_ids"][32:]
    # a prompt of at most L // 2 tokens is never cut: the response takes the rest
    short = ex("hi", LONG)
    p = len(encode_prompt(tokenizer, short.prompt))
    [f], report = tokenize_sft([short], tokenizer, 2 * p + 1)
    assert (report.prompt_truncated, report.response_truncated) == (0, 1)
    assert f["labels"] == [IGNORE_INDEX] * p + encode_response(tokenizer, LONG)[:p + 1]


def test_pairs_share_prompt_cut_and_drop_identical_after_truncation(tokenizer):
    common = LONG + " and then"
    keep_pair = ex(LONG, "Yes, gladly.", "No, never.")
    same_start = ex("hi", common + " yes", common + " no")  # differ only after 60 words
    features, report = tokenize_pairs([keep_pair, same_start], tokenizer, max_seq_len=40)
    assert report.kept == 1 and report.dropped == {"identical after truncation": 1}
    assert report.first_drops == [(1, "identical after truncation")]
    [f] = features
    prompt = encode_prompt(tokenizer, keep_pair.prompt)
    chosen, rejected = encode_response(tokenizer, "Yes, gladly."), encode_response(tokenizer, "No, never.")
    n = 40 - max(len(chosen), len(rejected))  # prompt tokens kept, the same for both
    assert f["prompt_len"] == n and report.prompt_truncated == 1 and report.response_truncated == 0
    assert f["chosen_input_ids"] == prompt[-n:] + chosen
    assert f["rejected_input_ids"] == prompt[-n:] + rejected
    assert "identical after truncation 1" in report.summary()


def test_by_source_tags_each_feature_and_counts_drops_in_the_given_order(tokenizer):
    common = LONG + " and then"
    rows = [ex("a", "Yes.", "No."), ex("hi", common + " yes", common + " no"), ex("b", "Fine.", "Bad."), ex("c", "Ok.", "Meh.")]
    for row, source in zip(rows, ["hh", "hh", "help", "hh"]):
        row.meta["source"] = source
    features, report = tokenize_by_source(tokenize_pairs, rows, tokenizer, 40)
    alone = [tokenize_pairs([r], tokenizer, 40)[0][0] for r in (rows[0], rows[3], rows[2])]
    # the sources in the order they first appear, each one's rows in their order; row 1 dropped
    assert features == [{**alone[0], "source": "hh"}, {**alone[1], "source": "hh"}, {**alone[2], "source": "help"}]
    assert (report.examples, report.kept, report.response_truncated) == (4, 3, 0)
    assert report.dropped == {"identical after truncation": 1} and report.first_drops == [(1, "identical after truncation")]


def test_prompts_cut_at_turn_boundary_keeping_system(tokenizer):
    system = {"role": "system", "content": "You answer in one word."}
    turns = [{"role": "user", "content": LONG}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": "Name a colour."}]
    full = encode_prompt(tokenizer, [system] + turns)
    last_only = encode_prompt(tokenizer, [system, turns[2]])
    fits = ex([system] + turns)
    too_long = ex([system, {"role": "user", "content": LONG}])
    short = ex([system, {"role": "user", "content": "Fruit?"}])
    features, report = tokenize_prompts([fits, too_long, short], tokenizer, max_prompt_len=len(last_only) + 3)
    assert len(full) > len(last_only) + 3
    assert [f["index"] for f in features] == [0, 2]
    assert features[0]["prompt_ids"] == last_only  # earliest user/assistant turns dropped, system kept
    assert features[1]["prompt_ids"] == encode_prompt(tokenizer, short.prompt)
    assert report.prompt_truncated == 1 and report.response_truncated == 0
    assert report.dropped == {"prompt too long even with only its last user turn": 1}


def test_nothing_survives_is_an_error(tokenizer):
    from rlhfkit.errors import DataError

    with pytest.raises(DataError, match="no example survived tokenisation"):
        tokenize_prompts([ex(LONG)], tokenizer, max_prompt_len=8)


def test_collate_sft_right_pads(tokenizer):
    pad = tokenizer.pad_token_id
    assert pad != tokenizer.eos_token_id
    features = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    batch = collate_sft(features, pad)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, pad, pad]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert all(t.dtype == torch.long for t in batch.values())


def test_collate_pairs_chosen_then_rejected():
    features = [{"chosen_input_ids": [1, 2, 3], "rejected_input_ids": [1, 2], "prompt_len": 1},
                {"chosen_input_ids": [4, 5], "rejected_input_ids": [4, 6, 7, 8], "prompt_len": 1}]
    batch = collate_pairs(features, pad_token_id=0)
    assert batch["input_ids"].shape == (4, 4)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [4, 5, 0, 0], [1, 2, 0, 0], [4, 6, 7, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch["prompt_len"].tolist() == [1, 1, 1, 1]


def test_collate_packed_pairs_layout_positions_and_mask():
    # pair 0: prompt [1], chosen [2, 3], rejected [4]; pair 1: prompt [5, 6], chosen [] (only the prompt), rejected [7]
    features = [{"chosen_input_ids": [1, 2, 3], "rejected_input_ids": [1, 4], "prompt_len": 1},
                {"chosen_input_ids": [5, 6], "rejected_input_ids": [5, 6, 7], "prompt_len": 2}]
    b = collate_packed_pairs(features, pad_token_id=0)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 1], [0, 1, 2, 0]]  # the rejected side restarts after the prompt
    assert b["chosen_end"].tolist() == [2, 1] and b["rejected_end"].tolist() == [3, 2]
    T, F = True, False
    assert b["pair_mask"][0].tolist() == [[T, F, F, F],   # prompt
                                          [T, T, F, F],   # chosen
                                          [T, T, T, F],
                                          [T, F, F, T]]   # rejected: the prompt and itself, not the chosen tokens
    assert b["pair_mask"][1].tolist() == [[T, F, F, F], [T, T, F, F], [T, T, T, F],
                                          [F, F, F, T]]   # padding sees only itself
    # a rejected side cut to nothing is scored at the prompt's last token, as its collate_pairs row would be
    b = collate_packed_pairs([{"chosen_input_ids": [1, 2, 3], "rejected_input_ids": [1, 2], "prompt_len": 2}], 0)
    assert b["chosen_end"].tolist() == [2] and b["rejected_end"].tolist() == [1]
    with pytest.raises(ValueError, match="share their first prompt_len tokens"):
        collate_packed_pairs([{"chosen_input_ids": [1, 2], "rejected_input_ids": [9, 3], "prompt_len": 1}], 0)


def test_collate_prompts_left_pads():
    batch = collate_prompts([{"prompt_ids": [1, 2, 3], "index": 4}, {"prompt_ids": [9], "index": 0}], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [0, 0, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch["index"].tolist() == [4, 0]


def test_end_to_end_real_pairs(shared_data, tokenizer):
    """hh-rlhf step-2 rows -> pairs -> one batch; every row ends at its EOS unless cut."""
    from rlhfkit.data import load_phase_data

    train, _, _ = load_phase_data(str(shared_data / "hh-rlhf-harmless-base" / "pairs.jsonl.gz"), 2, "pairs")
    features, report = tokenize_pairs(train[:16], tokenizer, max_seq_len=256)
    assert report.kept + sum(report.dropped.values()) == 16
    batch = collate_pairs(features, tokenizer.pad_token_id)
    B = len(features)
    assert batch["input_ids"].shape[0] == 2 * B and batch["input_ids"].shape[1] <= 256
    lengths = batch["attention_mask"].sum(1)
    last = batch["input_ids"][torch.arange(2 * B), lengths - 1]
    assert int((last == tokenizer.eos_token_id).sum()) >= 2 * B - 2 * report.response_truncated


def test_prompt_suffix_goes_to_the_last_user_turn_only():
    from rlhfkit.data import Example, with_prompt_suffix

    ex = Example([{"role": "system", "content": "s"}, {"role": "user", "content": "Q1 "}, {"role": "assistant", "content": "a"},
                  {"role": "user", "content": "Q2  "}], None, None, {"answer": "#### 1", "row": 3})
    out = with_prompt_suffix([ex], " Output the final answer after '####'.")
    assert [m["content"] for m in out[0].prompt] == ["s", "Q1 ", "a", "Q2 Output the final answer after '####'."]
    assert out[0].meta is ex.meta and ex.prompt[-1]["content"] == "Q2  "  # the input is not modified
