"""postprocess: the one place that turns raw generated tokens into a RolloutBatch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhfkit.errors import ConfigError
from rlhfkit.rollout import GenerationConfig, PromptBatch, RolloutBatch, postprocess

PAD, EOS = 0, 2
PROMPT = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 0, 4]])
PMASK = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]])


def test_eos_at_different_positions_and_truncation():
    gen = torch.tensor([
        [11, EOS, 12, 13, 14],  # EOS second: length 2
        [EOS, 15, 16, 17, 18],  # EOS first: length 1
        [21, 22, 23, 24, 25],   # no EOS: truncated, length 5
    ])
    b = postprocess(PROMPT, PMASK, gen, EOS, PAD)
    assert b.response_ids.tolist() == [[11, EOS, PAD, PAD, PAD], [EOS, PAD, PAD, PAD, PAD], [21, 22, 23, 24, 25]]
    assert b.action_mask.tolist() == [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert b.truncated.tolist() == [False, False, True]
    assert b.response_lengths.tolist() == [2, 1, 5]
    assert b.empty.tolist() == [False, True, False]  # EOS first: nothing said
    assert torch.equal(b.sequences, torch.cat([PROMPT, b.response_ids], 1))
    assert b.attention_mask.tolist() == [[0, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1]]
    assert b.attention_mask.dtype == PMASK.dtype


def test_width_is_longest_response_in_batch():
    # generate() pads finished rows to the batch's length; after cutting, A = longest response (3 here)
    gen = torch.tensor([[11, EOS, PAD, PAD, PAD, PAD], [12, 13, EOS, PAD, PAD, PAD], [EOS, 99, 98, 97, 96, 95]])
    b = postprocess(PROMPT, PMASK, gen, EOS, PAD)
    assert b.response_ids.shape == (3, 3)
    assert b.response_ids.tolist() == [[11, EOS, PAD], [12, 13, EOS], [EOS, PAD, PAD]]
    assert not b.truncated.any()


def test_garbage_after_eos_becomes_pad():
    gen = torch.tensor([[EOS, 31, 32], [33, EOS, 34], [35, 36, EOS]])
    b = postprocess(PROMPT, PMASK, gen, EOS, PAD)
    assert b.response_ids.tolist() == [[EOS, PAD, PAD], [33, EOS, PAD], [35, 36, EOS]]
    assert b.action_mask.tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


def test_multiple_eos_ids_first_one_wins():
    eos_ids = [EOS, 3]
    gen = torch.tensor([[11, 3, EOS, 12], [EOS, 3, 13, 14], [15, 16, 17, 18]])
    b = postprocess(PROMPT, PMASK, gen, eos_ids, PAD)
    assert b.response_lengths.tolist() == [2, 1, 4]
    assert b.response_ids.tolist() == [[11, 3, PAD, PAD], [EOS, PAD, PAD, PAD], [15, 16, 17, 18]]
    assert b.truncated.tolist() == [False, False, True]


def test_pad_equal_to_eos_keeps_the_real_eos():
    # pad == eos: the first EOS is the response's last action (mask 1); the tail is EOS-as-pad (mask 0)
    gen = torch.tensor([[11, EOS, EOS, EOS], [12, 13, 14, EOS], [EOS, EOS, EOS, EOS]])
    b = postprocess(PROMPT, PMASK, gen, EOS, pad_id=EOS)
    assert b.action_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert b.response_ids.tolist() == [[11, EOS, EOS, EOS], [12, 13, 14, EOS], [EOS, EOS, EOS, EOS]]
    assert not b.truncated.any()
    # the reward is read at the last real token: the EOS itself
    last = b.response_lengths - 1
    assert b.response_ids.gather(1, last[:, None]).squeeze(1).tolist() == [EOS, EOS, EOS]


def test_all_truncated_and_single_token():
    gen = torch.tensor([[41], [42], [EOS]])
    b = postprocess(PROMPT, PMASK, gen, EOS, PAD)
    assert b.truncated.tolist() == [True, True, False]
    assert b.action_mask.tolist() == [[1], [1], [1]]
    assert b.empty.tolist() == [False, False, True]  # one token cut by the limit is said; EOS alone is not


def test_empty_batch():
    b = postprocess(PROMPT[:0], PMASK[:0], torch.zeros(0, 5, dtype=torch.long), EOS, PAD)
    assert b.response_ids.shape == (0, 0) and b.action_mask.shape == (0, 0) and b.truncated.shape == (0,)
    assert len(b) == 0 and b.sequences.shape == (0, 3)


def test_eos_inside_the_prompt_is_ignored():
    prompt = torch.tensor([[EOS, 5, EOS]])
    b = postprocess(prompt, torch.ones_like(prompt), torch.tensor([[7, 8, EOS, 9]]), EOS, PAD)
    assert b.response_lengths.tolist() == [3]
    assert b.prompt_ids.tolist() == [[EOS, 5, EOS]]


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError):
        postprocess(PROMPT, PMASK, torch.zeros(2, 4, dtype=torch.long), EOS, PAD)


def test_rollout_batch_fields_and_properties_by_hand():
    # responses of 2, 3 (no EOS: truncated) and 1 tokens; A = 3
    gen = torch.tensor([[11, EOS, 12], [13, 14, 15], [EOS, 16, 17]])
    b = postprocess(PROMPT, PMASK, gen, EOS, PAD)
    assert isinstance(b, RolloutBatch) and len(b) == 3
    assert [f.name for f in dataclasses.fields(b)] == ["prompt_ids", "prompt_mask", "response_ids", "action_mask", "truncated"]
    assert torch.equal(b.prompt_ids, PROMPT) and torch.equal(b.prompt_mask, PMASK)
    assert torch.equal(b.response_ids, torch.tensor([[11, EOS, PAD], [13, 14, 15], [EOS, PAD, PAD]]))
    assert torch.equal(b.action_mask, torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]]))
    assert torch.equal(b.truncated, torch.tensor([False, True, False]))
    # properties: prompt ++ response, prompt_mask ++ action_mask, tokens up to and including EOS
    assert torch.equal(b.sequences, torch.tensor([[0, 5, 6, 11, EOS, PAD], [7, 8, 9, 13, 14, 15], [0, 0, 4, EOS, PAD, PAD]]))
    assert torch.equal(b.attention_mask, torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0]]))
    assert torch.equal(b.response_lengths, torch.tensor([2, 3, 1]))
    assert (b.response_ids.dtype, b.action_mask.dtype, b.truncated.dtype) == (torch.long, PMASK.dtype, torch.bool)


# GenerationConfig / PromptBatch validation --------------------------------------------------


def test_generation_config_defaults_and_hf_translation():
    g = GenerationConfig(max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD)
    assert (g.temperature, g.top_p, g.top_k, g.min_new_tokens, g.do_sample) == (1.0, 1.0, 0, 0, True)
    assert g.eos_ids == [EOS]
    hf = g.to_hf()
    assert (hf.max_new_tokens, hf.min_new_tokens, hf.do_sample, hf.top_k, hf.top_p, hf.temperature) == (8, 0, True, 0, 1.0, 1.0)
    assert hf.eos_token_id == [EOS] and hf.pad_token_id == PAD and hf.use_cache is True and hf.num_beams == 1
    greedy = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=[EOS, 3], pad_token_id=PAD).to_hf()
    assert greedy.do_sample is False and greedy.eos_token_id == [EOS, 3]


@pytest.mark.parametrize("kwargs", [
    dict(max_new_tokens=0), dict(temperature=0.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
    dict(min_new_tokens=9), dict(min_new_tokens=-1), dict(eos_token_id=[]),
])
def test_generation_config_refuses_bad_values(kwargs):
    base = dict(max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD)
    with pytest.raises(ConfigError):
        GenerationConfig(**{**base, **kwargs})


def test_generation_config_is_keyword_only():
    with pytest.raises(TypeError):
        GenerationConfig(8, 1.0)  # type: ignore[misc]


def test_prompt_batch_must_be_left_padded():
    PromptBatch(PROMPT, PMASK)
    with pytest.raises(ValueError, match="left-padded"):
        PromptBatch(torch.tensor([[5, 6, 0]]), torch.tensor([[1, 1, 0]]))
    with pytest.raises(ValueError):
        PromptBatch(PROMPT, PMASK[:, :2])
