"""The attention kernel choice for trained models: the rule, and that it changes no number."""

import torch

from rlhfkit.models import load_model, train_attention
from rlhfkit.models.cpu_bf16 import ENV


def test_auto_rule(monkeypatch):
    assert train_attention("auto", 256, on_cuda=False) == "eager"
    assert train_attention("auto", 512, on_cuda=False) == "eager"
    assert train_attention("auto", 513, on_cuda=False) is None  # the model's default (SDPA)
    assert train_attention("auto", 256, on_cuda=True) is None
    assert train_attention("sdpa", 256, on_cuda=False) == "sdpa"
    assert train_attention("flash_attention_2", 4096, on_cuda=True) == "flash_attention_2"
    # bf16 with fp32 products (a CPU without bf16 kernels): eager's bf16 matmuls would take the slow path
    monkeypatch.setenv(ENV, "fp32")
    assert train_attention("auto", 256, on_cuda=False, dtype="bf16") is None
    assert train_attention("auto", 256, on_cuda=False, dtype="fp32") == "eager"
    assert train_attention("eager", 256, on_cuda=False, dtype="bf16") == "eager"
    monkeypatch.setenv(ENV, "native")
    assert train_attention("auto", 256, on_cuda=False, dtype="bf16") == "eager"


def _loss_and_grads(path, attn, ids, mask):
    torch.manual_seed(0)
    model = load_model(str(path), "causal_lm", dtype="fp32", attn_implementation=attn)
    assert model.config._attn_implementation == attn
    model.train()
    logits = model(input_ids=ids, attention_mask=mask).logits
    # next-token targets from real positions to real positions (a pad query row sees no key at all,
    # and the two kernels fill such rows differently; no program reads them)
    targets = ids[:, 1:].masked_fill((mask[:, 1:] == 0) | (mask[:, :-1] == 0), -100)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), targets.reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_eager_and_sdpa_agree_on_padded_batches(tiny_dir):
    """Left and right padding in one run: the same loss and gradients (fp32) with either kernel, so
    the auto choice is a speed choice only."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 200, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0   # left padding
    mask[1, 9:] = 0   # right padding
    mask[2, :2] = 0
    ids = ids.masked_fill(mask == 0, 0)
    loss_e, grads_e = _loss_and_grads(tiny_dir, "eager", ids, mask)
    loss_s, grads_s = _loss_and_grads(tiny_dir, "sdpa", ids, mask)
    assert torch.isfinite(loss_e)
    torch.testing.assert_close(loss_e, loss_s, rtol=1e-5, atol=1e-6)
    for name in grads_e:
        torch.testing.assert_close(grads_e[name], grads_s[name], rtol=1e-4, atol=1e-6, msg=name)
