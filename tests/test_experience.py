"""Step 3's forward passes: group packing (one row per GRPO group) against the rows run apart."""

from __future__ import annotations

import json

import pytest
import torch

from rlhfkit.experience import Experience, actor_forward, group_packing_pays, pack_groups
from rlhfkit.models import attention_span, load_model

PAD, EOS = 0, 2


def test_pack_groups_layout_by_hand():
    # two groups of G=2; prompt P=3 (the second group's prompt has one left pad); A=3
    seqs = torch.tensor([[PAD, 5, 6, 7, EOS, PAD],
                         [PAD, 5, 6, 8, 9, 10],
                         [11, 12, 13, EOS, PAD, PAD],
                         [11, 12, 13, 14, 15, EOS]])
    seqs = seqs[[2, 3, 0, 1]]  # group 0: full prompt, group 1: left-padded prompt
    mask = (seqs != PAD).long()
    packed = pack_groups(seqs, mask, prompt_len=3, group_size=2)
    assert packed.input_ids.tolist() == [[11, 12, 13, EOS, PAD, PAD, 14, 15, EOS],
                                         [PAD, 5, 6, 7, EOS, PAD, 8, 9, 10]]
    # prompt positions skip the left pad; each response restarts where its prompt ends
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 3, 4, 5],
                                            [0, 0, 1, 2, 3, 4, 2, 3, 4]]
    a = packed.allowed[1].int()
    assert a[7].tolist() == [0, 1, 1, 0, 0, 0, 1, 1, 0]  # response 2 token 1: prompt's real tokens + itself, not response 1
    assert a[4].tolist() == [0, 1, 1, 1, 1, 0, 0, 0, 0]  # response 1's EOS: prompt + response 1 so far
    assert a[5].tolist() == [0, 0, 0, 0, 0, 1, 0, 0, 0]  # padding sees only itself, and nobody sees it
    assert a[:, 5].tolist() == [0, 0, 0, 0, 0, 1, 0, 0, 0]
    assert a[0].tolist() == [1, 0, 0, 0, 0, 0, 0, 0, 0]  # the left pad too
    # of the last G*A+1 = 7 positions (from P-1 = 2): token 0 of each response is predicted at the
    # prompt's end, token t at the response's own token t-1
    assert packed.logit_index.tolist() == [0, 1, 2, 0, 4, 5]


def test_pack_groups_refuses_what_is_not_a_group():
    seqs = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 10], [5, 4, 7, 8], [5, 4, 1, 2]])
    mask = torch.ones_like(seqs)
    assert pack_groups(seqs, mask, 2, 2) is not None
    assert pack_groups(seqs, mask, 2, 4) is None  # the four rows have two prompts
    assert pack_groups(seqs[:3], mask[:3], 2, 2) is None  # not whole groups
    assert pack_groups(seqs, mask, 2, 1) is None
    other_mask = mask.clone()
    other_mask[1, 0] = 0  # same ids, different padding
    assert pack_groups(seqs, other_mask, 2, 2) is None


def test_group_packing_pays_by_hand():
    # span 100, P 10, A 5, G 4: packed 30 + 9 = 39 < 4 * (15 + 2.25) = 69
    assert group_packing_pays(10, 5, 4, 100.0)
    # long responses in a big group: packed 810 + 6561 > 8 * (110 + 121)
    assert not group_packing_pays(10, 100, 8, 100.0)
    assert not group_packing_pays(10, 5, 1, 100.0) and not group_packing_pays(10, 5, 4, None)


def test_group_packing_pays_for_every_shorter_response():
    """The closed form in its docstring: it pays exactly when G * A^2 < P * span + P^2, so a shorter
    response pays wherever a longer one does."""
    for P in (1, 7, 40, 300):
        for G in (2, 4, 8):
            pays = [group_packing_pays(P, A, G, 150.0) for A in range(1, 200)]
            assert pays == [G * A * A < P * 150.0 + P * P for A in range(1, 200)]
            assert pays == sorted(pays, reverse=True)


def _experience(n: int, prompt_len: int = 2, answer_len: int = 3) -> Experience:
    """n samples whose every field holds the sample's index (responses of index % 3 + 1 tokens)."""
    idx = torch.arange(n)
    lengths = idx % answer_len + 1
    amask = (torch.arange(answer_len)[None] < lengths[:, None]).float()
    per_token = idx[:, None].float().expand(n, answer_len) * amask
    seqs = torch.cat([idx[:, None].expand(n, prompt_len), (idx[:, None] + 100).expand(n, answer_len)], dim=1)
    return Experience(sequences=seqs, attention_mask=torch.cat([torch.ones(n, prompt_len), amask], dim=1).long(),
                      action_mask=amask, loss_mask=amask, old_logprobs=None, ref_logprobs=per_token, values=None,
                      scores=idx.float(), raw_scores=idx.float(), rewards=per_token, advantages=per_token, returns=per_token,
                      kl=per_token, truncated=torch.zeros(n, dtype=torch.bool), prompt_len=prompt_len)


def test_minibatches_keep_whole_groups_when_the_group_size_divides_them():
    exp = _experience(12)
    for size, groups in ((2, 2), (4, 2), (6, 3), (4, 4), (12, 2)):
        seen = []
        for mb in exp.minibatches(size, torch.Generator().manual_seed(1), group_size=groups):
            ids = mb.scores.long()
            assert len(mb) == size and torch.equal(mb.sequences[:, 0], ids)  # every field is the same samples'
            assert torch.equal(mb.advantages[:, 0], ids.float())
            assert mb.action_mask.shape[1] == 3 and mb.sequences.shape[1] == 5  # untrimmed: the packed layout of the batch
            starts = ids.view(-1, groups)
            assert torch.equal(starts, starts[:, :1] + torch.arange(groups)) and bool((starts[:, 0] % groups == 0).all()), ids
            seen += ids.tolist()
        assert sorted(seen) == list(range(12))
    # shuffled: the groups come in another order than 0, 1, 2, ...
    orders = {tuple(mb.scores.long().tolist()) for mb in exp.minibatches(12, torch.Generator().manual_seed(3), group_size=2)}
    assert orders != {tuple(range(12))}
    # a size the group does not divide, or a batch of part groups: shuffled sample by sample, all seen once
    for size, groups, n in ((5, 2, 12), (4, 2, 11), (1, 2, 12)):
        seen, widths = [], []
        for mb in _experience(n).minibatches(size, torch.Generator().manual_seed(0), group_size=groups):
            widths.append(mb.action_mask.shape[1])
            assert widths[-1] == int(mb.action_mask.sum(-1).max())  # trimmed to its longest response
            seen += mb.scores.long().tolist()
        assert sorted(seen) == list(range(n))
    assert min(widths) == 1  # one-sample mini-batches of 1-token responses


def gsm8k_groups(tokenizer, shared_data, n_prompts: int, G: int, A: int):
    """Real GSM8K prompts (chat template, left-padded), each repeated G times, with random responses
    of different lengths: EOS inside some, none in others, pad after the EOS."""
    rows = [json.loads(x) for x in open(shared_data / "gsm8k" / "test_first1000.jsonl")][:n_prompts]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}], add_generation_prompt=True)
               for r in rows]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    P = max(map(len, prompts))
    g = torch.Generator().manual_seed(0)
    seqs, masks = [], []
    for i, p in enumerate(prompts):
        for j in range(G):
            n = A if (i + j) % 3 == 0 else int(torch.randint(2, A, (1,), generator=g))
            resp = torch.randint(100, 5000, (n,), generator=g).tolist()
            if n < A:
                resp[-1] = tokenizer.eos_token_id
            pad = tokenizer.pad_token_id
            seqs.append([pad] * (P - len(p)) + p + resp + [pad] * (A - n))
            masks.append([0] * (P - len(p)) + [1] * (len(p) + n) + [0] * (A - n))
    return torch.tensor(seqs), torch.tensor(masks), P


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_groups_give_the_logprobs_and_gradients_of_the_rows_apart(tiny_dir, tokenizer, shared_data, attn):
    """fp32, real GSM8K prompts, 2 groups of 3: packed logprobs, entropy, and the gradient of a
    loss on them equal the rows run apart."""
    seqs, mask, P = gsm8k_groups(tokenizer, shared_data, n_prompts=2, G=3, A=12)
    model = load_model(str(tiny_dir), "causal_lm", dtype="fp32", pad_token_id=tokenizer.pad_token_id, attn_implementation=attn)
    assert group_packing_pays(P, 12, 3, attention_span(model))
    assert pack_groups(seqs, mask, P, 3) is not None
    action = mask[:, P:].float()

    def run(group_size):
        model.zero_grad()
        logp, ent = actor_forward(model, seqs, mask, P, temperature=0.7, with_entropy=True, group_size=group_size)
        loss = ((logp * torch.linspace(-1, 1, logp.shape[1])) * action).sum() + (ent * action).sum() * 0.1
        loss.backward()
        return logp.detach() * action, ent.detach() * action, [p.grad.clone() for p in model.parameters()]

    ref_lp, ref_ent, ref_grads = run(1)
    lp, ent, grads = run(3)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    for g, ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-5)


def test_attention_span_of_the_tiny_model(tiny_dir, tokenizer):
    model = load_model(str(tiny_dir), "causal_lm", dtype="fp32", pad_token_id=tokenizer.pad_token_id)
    n = sum(p.numel() for p in model.parameters())
    assert attention_span(model) == pytest.approx(n / (2 * 64 * 2))


def test_a_packed_minibatch_of_whole_groups_scores_as_in_its_batch(base_dir, tokenizer, shared_data):
    """bf16 SmolLM2, 3 GSM8K groups of 2 with responses of different lengths: each mini-batch of one whole
    group is that group's row as it lies in the batch, untrimmed, and gets its packed logprobs bit for bit
    (trimming it would move its second response within the row, and bf16 rounds it differently). The
    reference is the group's row of the batch scored alone, not the batch scored at once: some CPUs'
    GEMM kernels depend on the number of rows (oneDNN's bf16 kernels on AVX-512 move these logprobs by
    up to ~0.4 nats between 1 and 3 packed rows), which no layout can undo."""
    seqs, mask, P = gsm8k_groups(tokenizer, shared_data, n_prompts=3, G=2, A=20)
    model = load_model(str(base_dir), dtype="bf16").eval()
    assert group_packing_pays(P, 20, 2, attention_span(model))
    n = len(seqs)
    amask = mask[:, P:].float()
    exp = Experience(sequences=seqs, attention_mask=mask, action_mask=amask, loss_mask=amask, old_logprobs=None,
                     ref_logprobs=amask, values=None, scores=torch.arange(n).float(), raw_scores=torch.zeros(n), rewards=amask,
                     advantages=amask, returns=amask, kl=amask, truncated=torch.zeros(n, dtype=torch.bool), prompt_len=P)
    with torch.no_grad():
        in_batch = torch.cat([actor_forward(model, seqs[g:g + 2], mask[g:g + 2], P, group_size=2)[0] for g in (0, 2, 4)])
        assert int(amask[2:4].sum(-1).max()) < 20  # the second group would be trimmed
        seen = []
        for mb in exp.minibatches(2, torch.Generator().manual_seed(0), group_size=2):
            rows = mb.scores.long()
            assert torch.equal(mb.sequences, seqs[rows]) and torch.equal(mb.attention_mask, mask[rows])
            got, _ = actor_forward(model, mb.sequences, mb.attention_mask, P, group_size=2)
            assert torch.equal(got * mb.action_mask, in_batch[rows] * mb.action_mask)
            seen += rows.tolist()
        assert sorted(seen) == list(range(n))
