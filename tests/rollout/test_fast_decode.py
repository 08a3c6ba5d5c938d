"""The Llama decode step of the hf backend (rlhfkit.rollout.fast_decode): where it runs, and that it
gives the model's own tokens (greedy decoding equals ``generate``, padded prompts included)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from rlhfkit.models import load_model
from rlhfkit.models.cpu_bf16 import ENV
from rlhfkit.rollout import GenerationConfig, PromptBatch, make_rollout_engine
from rlhfkit.rollout.fast_decode import supports

PAD = 0


@pytest.fixture(autouse=True)
def bf16_kernels_as_the_model_s(monkeypatch):
    """Bit-for-bit comparisons with ``generate`` on the model's own bf16 kernels: the decoder does not
    switch to fp32 products and attention even on a CPU without bf16 kernels (rlhfkit.models.cpu_bf16),
    except where a test says so."""
    monkeypatch.setenv(ENV, "native")


def tiny_llama(dtype: torch.dtype, attn: str = "sdpa", kv_heads: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads, initializer_range=0.2, eos_token_id=None, pad_token_id=PAD,
                      attn_implementation=attn)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def generate(model, ids, mask, new: int, pad: int = PAD) -> torch.Tensor:
    model.generation_config = type(model.generation_config)()
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=[999],
                              pad_token_id=pad)[:, ids.shape[1]:]


def decode_counting_forwards(model, ids, mask, new: int, pad: int = PAD) -> tuple[torch.Tensor, int]:
    """The hf backend's greedy tokens and how many times the transformers body (``model.model``) ran."""
    calls = []
    body = model.model
    body.register_forward_pre_hook(lambda *_: calls.append(1))
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=[999], pad_token_id=pad)
    try:
        got = make_rollout_engine("hf", model).generate(PromptBatch(ids, mask), gen).response_ids
    finally:
        body._forward_pre_hooks.clear()
    return got, len(calls)


def prompts(rows: int = 4, length: int = 7, vocab: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = PAD, 0
    ids[3, :5], mask[3, :5] = PAD, 0
    return ids, mask


def gsm8k_prompts(tokenizer, shared_data) -> tuple[torch.Tensor, torch.Tensor]:
    """Two real GSM8K questions of different lengths, chat-formatted and left-padded (one row padded)."""
    with open(shared_data / "gsm8k" / "test_first1000.jsonl") as f:
        questions = [json.loads(next(f))["question"] for _ in range(2)]
    rows = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True)
            for q in questions]
    rows = [list(r["input_ids"]) if isinstance(r, dict) or hasattr(r, "keys") else list(r) for r in rows]
    width, pad = max(map(len, rows)), tokenizer.pad_token_id
    assert min(map(len, rows)) < width
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def test_runs_only_where_checked():
    assert supports(tiny_llama(torch.float32))
    assert not supports(tiny_llama(torch.float32, attn="eager"))
    assert not supports(tiny_llama(torch.float32).train())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("padded", [True, False])
def test_greedy_tokens_equal_generate_and_the_body_runs_once(dtype, kv_heads, padded):
    """Grouped-query (2 or 4 query heads a KV head) and multi-head attention, with and without left
    padding: the tokens of ``generate``; the transformers body runs for the prefill only."""
    model = tiny_llama(dtype, kv_heads=kv_heads)
    ids, mask = prompts()
    if not padded:
        ids, mask = ids[[0, 2]], mask[[0, 2]]
    got, body_calls = decode_counting_forwards(model, ids, mask, 12)
    assert body_calls == 1
    assert torch.equal(got, generate(model, ids, mask, 12))


def test_eager_attention_keeps_the_model_forward():
    model = tiny_llama(torch.float32, attn="eager")
    ids, mask = prompts()
    got, body_calls = decode_counting_forwards(model, ids, mask, 6)
    assert body_calls == 6  # the prefill and 5 decode steps
    assert torch.equal(got, generate(model, ids, mask, 6))


def test_smollm2_bf16_on_gsm8k_prompts_gives_generate_s_tokens(base_dir, tokenizer, shared_data):
    """The real default model (30 layers, 9 query heads on 3 KV heads) in bf16, two real GSM8K
    questions of different lengths (so one row is left-padded), 24 greedy tokens."""
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    ids, mask = gsm8k_prompts(tokenizer, shared_data)
    pad = tokenizer.pad_token_id
    got, body_calls = decode_counting_forwards(model, ids, mask, 24, pad)
    assert body_calls == 1
    assert torch.equal(got, generate(model, ids, mask, 24, pad))


def test_smollm2_bf16_one_row_at_a_time_gives_generate_s_tokens(base_dir, tokenizer, shared_data):
    """One unpadded row, as `hf` decodes at 1 prompt per rank: no mask, so ``generate`` attends by SDPA's
    ``enable_gqa`` and the decoder must too (on an AVX-512 Xeon the query heads folded onto their
    key/value head parted from ``generate`` at the 7th-44th greedy token of every prompt tried)."""
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    ids, mask = gsm8k_prompts(tokenizer, shared_data)
    pad = tokenizer.pad_token_id
    for row in range(len(ids)):
        one, one_mask = ids[row:row + 1, mask[row].bool()], mask[row:row + 1, mask[row].bool()]
        got, body_calls = decode_counting_forwards(model, one, one_mask, 48, pad)
        assert body_calls == 1
        assert torch.equal(got, generate(model, one, one_mask, 48, pad)), row


def test_smollm2_with_fp32_products_gives_the_tokens_of_generate(base_dir, tokenizer, shared_data, monkeypatch):
    """Where bf16 layers take fp32 products (CPUs without bf16 kernels: rlhfkit.models.cpu_bf16), the
    decoder packs fp32 weights and attends in fp32 over fp32 KV buffers: the real model, loaded as the
    programs load it, gives the greedy tokens of its own ``generate``. Their sums differ in order only,
    so the bf16 logits can differ by an ulp: a row may part from ``generate`` only where ``generate``'s
    own top two logits are that close (a tie at bf16 resolution), and never before."""
    monkeypatch.setenv(ENV, "fp32")
    model = load_model(str(base_dir), dtype="bf16").eval()
    ids, mask = gsm8k_prompts(tokenizer, shared_data)
    pad = tokenizer.pad_token_id
    got, body_calls = decode_counting_forwards(model, ids, mask, 24, pad)
    assert body_calls == 1
    model.generation_config = type(model.generation_config)()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=[999],
                             pad_token_id=pad, output_scores=True, return_dict_in_generate=True)
    want = out.sequences[:, ids.shape[1]:]
    for row in range(len(ids)):
        parted = (got[row] != want[row]).nonzero()
        if len(parted):
            t = int(parted[0])
            scores = out.scores[t][row].float()
            ulp = 2.0 ** (torch.floor(torch.log2(scores.max())) - 7)  # bf16: 8 significant bits
            assert scores.max() - scores[got[row, t]] <= ulp, f"row {row} parts from generate at token {t} without a tie"
