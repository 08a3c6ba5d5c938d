"""One PPO update (rlhfkit.ppo.ppo_update) on hand-made tensors: the loss, the statistics and the
optimiser step are the hand computation.

The actor is a model whose logits are one learned bias over a two-token vocabulary, the same at
every position: with the bias at 0 every token has logprob -ln 2, its entropy is ln 2, and the
gradient of a token's logprob with respect to the bias is onehot(token) - 1/2."""

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from rlhfkit.experience import Experience
from rlhfkit.ppo import Trainables, UpdateSettings, mean_metrics, ppo_update

LN2 = math.log(2.0)


class BiasActor(torch.nn.Module):
    """logits[b, t] = bias for every row and position; backward/step as a DeepSpeed engine's (SGD, lr 1)."""

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(2))
        self.device = torch.device("cpu")
        self.steps = 0

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, logits_to_keep=None):
        T = input_ids.shape[1] if logits_to_keep is None else logits_to_keep
        return SimpleNamespace(logits=self.bias.expand(input_ids.shape[0], T, 2))

    def backward(self, loss):
        loss.backward()

    def step(self):
        with torch.no_grad():
            self.bias -= self.bias.grad
        self.bias.grad = None
        self.steps += 1


SETTINGS = UpdateSettings(clip_eps_low=0.2, clip_eps_high=0.2, loss_agg="token_mean", norm_constant=2.0, policy_loss="ppo",
                          entropy_coef=0.0, temperature=1.0, kl_in_loss=True, kl_estimator="k3", unsup_coef=0.5,
                          cliprange_value=0.2, ppo_epochs=1, minibatch_size=2, seed=0)
RATIOS = torch.tensor([[1.0, 1.5], [0.5, 1.0]])


def batch(old_logprobs):
    """Two samples, prompt token 0, responses (1, 0) and (0, <pad>): three tokens in the loss."""
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    logp = torch.full((2, 2), -LN2)
    ref = logp + torch.tensor([[0.0, LN2], [-LN2, 0.0]])  # d = ref - logp: 0, ln 2, -ln 2
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    z = torch.zeros(2, 2)
    return Experience(sequences=torch.tensor([[0, 1, 0], [0, 0, 1]]), attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]),
                      action_mask=mask, loss_mask=mask, old_logprobs=old_logprobs, ref_logprobs=ref, values=None,
                      scores=torch.zeros(2), raw_scores=torch.zeros(2), rewards=z, advantages=adv, returns=z, kl=z,
                      truncated=torch.zeros(2, dtype=torch.bool), prompt_len=1)


def test_one_update_by_hand():
    actor = BiasActor()
    ratios = torch.tensor([[1.0, 1.5], [0.5, 1.0]])
    mb = batch(old_logprobs=-LN2 - ratios.log())  # ratio = exp(logp - old)
    stats = ppo_update(Trainables(actor), mb, SETTINGS, kl_coef=0.1)

    # PPO-clip, eps 0.2, token mean over the 3 tokens:
    #   (0,0) r=1.0 A=1:  -min(1.0, 1.0)     = -1.0
    #   (0,1) r=1.5 A=1:  -min(1.5, 1.2)     = -1.2   (clipped)
    #   (1,0) r=0.5 A=-2: -min(-1.0, -1.6)   = +1.6   (clipped)
    policy = (-1.0 - 1.2 + 1.6) / 3
    # k3 = e^d - d - 1 with d = 0, ln 2, -ln 2: 0, 1 - ln 2, ln 2 - 1/2 (sum 1/2)
    kl = (0.0 + (1 - LN2) + (LN2 - 0.5)) / 3
    assert stats.policy_loss == pytest.approx(policy)
    assert stats.kl_loss == pytest.approx(kl)
    assert stats.clip_frac == pytest.approx(2 / 3)
    approx_kl = (0.0 + (1.5 - math.log(1.5) - 1) + (0.5 - math.log(0.5) - 1)) / 3  # k3 of pi_old || pi: r - ln r - 1
    assert stats.approx_kl == pytest.approx(approx_kl)
    assert stats.entropy == pytest.approx(LN2)
    assert stats.value_loss is None and stats.ptx_loss is None

    # gradient: only the unclipped token (0,0), y=1, moves the policy term: -A r (onehot(1) - 1/2) / 3;
    # k3's d/dlogp = 1 - e^d: 0, -1 (y=0), +1/2 (y=0), times beta / 3
    g_policy = torch.tensor([0.5, -0.5]) / 3
    g_kl = 0.1 * (-1.0 * torch.tensor([0.5, -0.5]) + 0.5 * torch.tensor([0.5, -0.5])) / 3
    torch.testing.assert_close(actor.bias.detach(), -(g_policy + g_kl))  # one SGD step, lr 1, from 0
    assert actor.steps == 1


def test_gspo_and_dr_grpo_aggregation_by_hand():
    # GSPO: s_0 = exp((0 + ln 1.5) / 2) = sqrt(1.5) with A = 1 -> -min(1.2247, 1.2) = -1.2 (clipped);
    #       s_1 = 0.5 (one token) with A = -2 -> -min(-1.0, -1.6) = 1.6 (clipped); mean over the 2 sequences
    actor = BiasActor()
    stats = ppo_update(Trainables(actor), batch(-LN2 - RATIOS.log()), replace(SETTINGS, policy_loss="gspo"), kl_coef=0.0)
    assert stats.policy_loss == pytest.approx((-1.2 + 1.6) / 2) and stats.clip_frac == 1.0
    assert torch.equal(actor.bias.detach(), torch.zeros(2))  # both sequences clipped: no gradient
    # Dr. GRPO: the PPO-clip token losses -1.0, -1.2, 1.6 summed, / (2 sequences x C = 2)
    stats = ppo_update(Trainables(BiasActor()), batch(-LN2 - RATIOS.log()), replace(SETTINGS, loss_agg="seq_mean_token_sum_norm"),
                       kl_coef=0.1)
    assert stats.policy_loss == pytest.approx((-1.0 - 1.2 + 1.6) / 4)
    assert stats.kl_loss == pytest.approx((0.0 + (1 - LN2) + (LN2 - 0.5)) / 4)  # the KL term is aggregated the same way


def test_entropy_bonus_by_hand():
    """With the bias at (ln 3, 0) every token has p = (3/4, 1/4) and entropy H; the bonus adds -coef * H to the loss,
    so one SGD step moves the bias by coef * dH/dbias more than without it, dH/dbias_k = -p_k (ln p_k + H)."""
    p = torch.tensor([0.75, 0.25])
    H = -(p * p.log()).sum()
    dH = -p * (p.log() + H)
    moved = []
    for coef in (0.0, 0.5):
        actor = BiasActor()
        with torch.no_grad():
            actor.bias.copy_(torch.tensor([math.log(3.0), 0.0]))
        stats = ppo_update(Trainables(actor), batch(None), replace(SETTINGS, entropy_coef=coef), kl_coef=0.0)
        moved.append(actor.bias.detach().clone())
        assert stats.entropy == pytest.approx(H.item())
        assert (stats.entropy_loss is None) if coef == 0 else stats.entropy_loss == pytest.approx(H.item())
    torch.testing.assert_close(moved[1] - moved[0], 0.5 * dH)


def test_the_single_update_takes_its_own_logprobs_as_old():
    actor = BiasActor()
    mb = batch(old_logprobs=None)
    stats = ppo_update(Trainables(actor), mb, SETTINGS, kl_coef=0.0)
    assert stats.policy_loss == pytest.approx(-(1 + 1 - 2) / 3)  # ratio 1: -mean(A)
    assert stats.clip_frac == 0 and stats.approx_kl == 0
    assert stats.kl_loss is None  # coefficient 0: no KL term
    torch.testing.assert_close(mb.old_logprobs, torch.full((2, 2), -LN2))
    k3 = torch.tensor([[0.0, 1 - LN2], [LN2 - 0.5, 0.0]])  # the KL of the metrics, from the filled-in old logprobs
    torch.testing.assert_close(mb.kl, k3)


def test_ptx_and_skipped_step():
    actor = BiasActor()
    ptx = {"input_ids": torch.tensor([[0, 1, 1]]), "attention_mask": torch.ones(1, 3), "labels": torch.tensor([[0, 1, 1]])}
    stats = ppo_update(Trainables(actor), batch(old_logprobs=None), SETTINGS, kl_coef=0.0, ptx_batch=ptx,
                       guard=lambda loss: False)
    assert stats.ptx_loss == pytest.approx(LN2)  # cross-entropy of a uniform two-token model
    assert actor.steps == 0 and actor.bias.grad is None  # the guard refused the step


def test_mean_metrics_over_updates():
    from rlhfkit.ppo import UpdateStats

    a = UpdateStats(policy_loss=1.0, clip_frac=0.0, approx_kl=0.5, entropy=2.0, value_loss=4.0, value_clip_frac=0.5)
    b = UpdateStats(policy_loss=3.0, clip_frac=1.0, approx_kl=0.5, entropy=0.0, value_loss=2.0, value_clip_frac=0.0)
    assert mean_metrics([a, b]) == {"policy/loss": 2.0, "policy/clip_frac": 0.5, "policy/approx_kl": 0.5, "policy/entropy": 1.0,
                                    "value/loss": 3.0, "value/clip_frac": 0.25}


def test_frozen_actor_trains_the_critic_alone(monkeypatch):
    """--freezing_actor_steps: no actor pass or step, the critic's step as usual, the reference's logprobs as old.
    The critic's value is its bias[0] at every position; V = V_old = 0, returns 1: the loss is 0.5 (1)^2 = 0.5 on
    each of the 3 tokens, and d loss / d bias[0] = mean(V - R) = -1, so SGD at lr 1 moves it to +1."""
    monkeypatch.setattr("rlhfkit.ppo.update.critic_forward",
                        lambda model, seqs, attn, P: model.bias[0].expand(seqs.shape[0], seqs.shape[1] - P))
    actor, critic = BiasActor(), BiasActor()
    mb = replace(batch(old_logprobs=None), values=torch.zeros(2, 2), returns=torch.ones(2, 2))
    stats = ppo_update(Trainables(actor, critic), mb, SETTINGS, kl_coef=0.1, train_actor=False)
    assert actor.steps == 0 and torch.equal(actor.bias.detach(), torch.zeros(2)) and actor.bias.grad is None
    assert critic.steps == 1 and critic.bias[0].item() == pytest.approx(1.0)
    assert stats.metrics() == {"value/loss": pytest.approx(0.5), "value/clip_frac": 0.0}  # no policy/* metrics
    assert mb.old_logprobs is mb.ref_logprobs
    trained = ppo_update(Trainables(actor, critic), replace(batch(old_logprobs=None), values=torch.zeros(2, 2),
                                                            returns=torch.ones(2, 2)), SETTINGS, kl_coef=0.1)
    assert actor.steps == 1 and "policy/loss" in trained.metrics()  # after the warm-up the actor trains again
