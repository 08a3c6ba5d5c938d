"""The algorithm registry (rlhfkit.rl): each advantage estimator against values computed by hand, the
registry's rules, and the derived settings of step 3's config."""

import math

import pytest
import torch

from rlhfkit.errors import ConfigError
from rlhfkit.rl import ADVANTAGE_ESTIMATORS, ALGOS, AlgoSpec, compute_advantages, register_advantage, with_kl_placement
from step3_ppo.config import Step3Config

LN2 = math.log(2.0)


DEFAULTS = dict(values=None, kl_coef=0.0, kl_estimator="k1", clip_reward_value=None, gamma=1.0, lam=0.95, group_size=2,
                whiten_advantages=False)


def advantages(algo, **kw):
    args = {**DEFAULTS, **kw}
    return compute_advantages(ALGOS[algo], **args)


def test_grpo_group_mean_and_unbiased_std():
    # groups (1, 0) and (3, 3); mask lengths 2, 1, 3, 1
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float)
    zeros = torch.zeros(4, 3)
    out = advantages("grpo", scores=torch.tensor([1.0, 0.0, 3.0, 3.0]), logprobs=zeros, ref_logprobs=zeros, mask=mask)
    std = math.sqrt((0.5 ** 2 + 0.5 ** 2) / (2 - 1))  # unbiased std of (1, 0)
    a = 0.5 / (std + 1e-6)
    expected = torch.tensor([[a, a, 0], [-a, 0, 0], [0, 0, 0], [0, 0, 0]])  # a flat group gets exactly 0
    torch.testing.assert_close(out.advantages, expected)
    torch.testing.assert_close(out.returns, expected)
    # the score sits on each sequence's last response token
    torch.testing.assert_close(out.rewards, torch.tensor([[0, 1.0, 0], [0.0, 0, 0], [0, 0, 3.0], [3.0, 0, 0]]))


def test_rloo_leave_one_out_with_the_kl_in_the_sequence_reward():
    mask = torch.tensor([[1, 1], [1, 1]], dtype=torch.float)
    ref = torch.zeros(2, 2)
    logp = torch.tensor([[0.1, 0.2], [0.0, 0.0]])  # k1 KL summed: 0.3 and 0
    out = advantages("rloo", scores=torch.tensor([1.0, 0.0]), logprobs=logp, ref_logprobs=ref, mask=mask, kl_coef=0.5)
    r0, r1 = 1.0 - 0.5 * 0.3, 0.0  # the sequence rewards carry -beta * KL
    a0, a1 = r0 - r1, r1 - r0  # baseline: the other sample of the group
    torch.testing.assert_close(out.advantages, torch.tensor([[a0, a0], [a1, a1]]))
    torch.testing.assert_close(out.kl, torch.tensor([[0.1, 0.2], [0.0, 0.0]]))


def test_ppo_gae_by_hand():
    mask = torch.ones(1, 2)
    logp, ref = torch.tensor([[0.2, -0.1]]), torch.zeros(1, 2)
    values = torch.tensor([[0.5, 0.25]])
    out = advantages("ppo", scores=torch.tensor([1.0]), logprobs=logp, ref_logprobs=ref, mask=mask, values=values, kl_coef=0.1,
                     clip_reward_value=5.0, group_size=1)
    r0, r1 = -0.1 * 0.2, -0.1 * -0.1 + 1.0  # -beta * k1 on each token, the score on the last
    delta1 = r1 + 1.0 * 0.0 - 0.25  # V past the end is 0
    delta0 = r0 + 1.0 * 0.25 - 0.5
    a1 = delta1
    a0 = delta0 + 1.0 * 0.95 * a1
    torch.testing.assert_close(out.rewards, torch.tensor([[r0, r1]]))
    torch.testing.assert_close(out.advantages, torch.tensor([[a0, a1]]))
    torch.testing.assert_close(out.returns, torch.tensor([[a0 + 0.5, a1 + 0.25]]))


def test_ppo_clips_the_score():
    mask, z = torch.ones(1, 1), torch.zeros(1, 1)
    out = advantages("ppo", scores=torch.tensor([9.0]), logprobs=z, ref_logprobs=z, mask=mask, values=z, clip_reward_value=5.0,
                     group_size=1)
    torch.testing.assert_close(out.rewards, torch.tensor([[5.0]]))


def test_reinforce_pp_returns_whitened_over_the_batch():
    mask = torch.ones(1, 2)
    logp, ref = torch.tensor([[0.2, -0.1]]), torch.zeros(1, 2)
    out = advantages("reinforce_pp", scores=torch.tensor([1.0]), logprobs=logp, ref_logprobs=ref, mask=mask, kl_coef=0.1,
                     group_size=1)
    g0, g1 = -0.02 + 1.01, 1.01  # returns with gamma 1: sums of the rewards from t on
    mean, var = (g0 + g1) / 2, ((g0 - 1.0) ** 2 + (g1 - 1.0) ** 2) / (2 - 1)
    torch.testing.assert_close(out.returns, torch.tensor([[g0, g1]]))
    expected = torch.tensor([[(g0 - mean) / math.sqrt(var + 1e-8), (g1 - mean) / math.sqrt(var + 1e-8)]])
    torch.testing.assert_close(out.advantages, expected)


def test_whitening_over_two_ranks_equals_one_rank():
    """all_reduce_sum carries the other rank's moments: half a batch each gives the whole batch's result."""
    torch.manual_seed(0)
    scores, mask = torch.randn(4), torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float)
    z = torch.zeros(4, 3)
    whole = advantages("grpo", scores=scores, logprobs=z, ref_logprobs=z, mask=mask, whiten_advantages=True)
    from rlhfkit.algos import masked_moments

    halves = []
    for mine, other in ((slice(0, 2), slice(2, 4)), (slice(2, 4), slice(0, 2))):
        other_moments = masked_moments(advantages("grpo", scores=scores[other], logprobs=z[other], ref_logprobs=z[other],
                                                  mask=mask[other]).advantages, mask[other])
        out = advantages("grpo", scores=scores[mine], logprobs=z[mine], ref_logprobs=z[mine], mask=mask[mine],
                         whiten_advantages=True, all_reduce_sum=lambda t, o=other_moments: t + o)
        halves.append(out.advantages)
    torch.testing.assert_close(torch.cat(halves), whole.advantages)


def test_scale_rewards_by_hand_and_batch_std_over_two_ranks():
    """Groups (1, 0) and (3, 3). batch: the unbiased std of all four rewards (mean 1.75, squares 6.75 / 3 = 2.25 -> 1.5);
    none (Dr. GRPO): the centred rewards themselves."""
    mask, z = torch.ones(4, 1), torch.zeros(4, 1)
    scores = torch.tensor([1.0, 0.0, 3.0, 3.0])
    batch = advantages("grpo", scores=scores, logprobs=z, ref_logprobs=z, mask=mask, scale_rewards="batch")
    torch.testing.assert_close(batch.advantages[:, 0], torch.tensor([0.5, -0.5, 0.0, 0.0]) / (1.5 + 1e-6))
    none = advantages("dr_grpo", scores=scores, logprobs=z, ref_logprobs=z, mask=mask, scale_rewards="none")
    torch.testing.assert_close(none.advantages[:, 0], torch.tensor([0.5, -0.5, 0.0, 0.0]))
    # two ranks, one group each: the other rank's (count, sum, sum of squares) arrive through all_reduce_sum
    halves = []
    for mine, other in ((slice(0, 2), slice(2, 4)), (slice(2, 4), slice(0, 2))):
        o = scores[other].double()
        theirs = torch.stack([o.sum(), o.square().sum(), torch.tensor(2.0, dtype=torch.float64)])  # masked_moments' order
        halves.append(advantages("grpo", scores=scores[mine], logprobs=z[mine], ref_logprobs=z[mine], mask=mask[mine],
                                 scale_rewards="batch", all_reduce_sum=lambda t, x=theirs: t + x).advantages)
    torch.testing.assert_close(torch.cat(halves), batch.advantages)


def test_objective_defaults_and_errors():
    dr = Step3Config(algo="dr_grpo", max_answer_seq_len=128)
    dr.validate_objective(dr.spec)
    assert (dr.loss_agg, dr.loss_norm_constant, dr.scale_rewards) == ("seq_mean_token_sum_norm", 128.0, "none")
    grpo = Step3Config(algo="grpo", scale_rewards="batch", loss_agg="seq_mean_token_mean")
    grpo.validate_objective(grpo.spec)
    assert (grpo.loss_agg, grpo.scale_rewards, grpo.policy_loss) == ("seq_mean_token_mean", "batch", "ppo")
    for flags, message in (({"algo": "ppo", "scale_rewards": "none"}, "applies to group-relative advantages"),
                           ({"algo": "grpo", "policy_loss": "cispo"}, "--policy_loss cispo: use one of ppo, gspo, gspo_token"),
                           ({"algo": "grpo", "scale_rewards": "global"}, "--scale_rewards global: use one of group, batch, none"),
                           ({"algo": "grpo", "entropy_coef": -0.1}, "--entropy_coef must be >= 0"),
                           ({"algo": "grpo", "loss_norm_constant": 0.0}, "--loss_norm_constant must be > 0")):
        cfg = Step3Config(**flags)
        with pytest.raises(ConfigError, match=message):
            cfg.validate_objective(cfg.spec)


def test_kl_placement_moves_the_kl_and_its_default_estimator():
    assert with_kl_placement(ALGOS["ppo"], None) is ALGOS["ppo"]
    moved = with_kl_placement(ALGOS["grpo"], "reward")
    assert (moved.kl_in_reward, moved.kl_in_loss, moved.kl_estimator) == (True, False, "k1")
    moved = with_kl_placement(ALGOS["dapo"], "loss")
    assert (moved.kl_in_reward, moved.kl_in_loss, moved.kl_estimator, moved.clip_eps) == (False, True, "k3", (0.2, 0.28))
    # PPO with no KL: GAE over the bare scores; with it in the reward, the k1 penalty on each token
    mask, ref = torch.ones(1, 2), torch.zeros(1, 2)
    logp = torch.tensor([[0.5, 0.25]])
    args = dict(scores=torch.tensor([1.0]), logprobs=logp, ref_logprobs=ref, mask=mask, values=torch.zeros(1, 2), kl_coef=0.2)
    none = compute_advantages(with_kl_placement(ALGOS["ppo"], "none"), **{**DEFAULTS, **args})
    reward = compute_advantages(ALGOS["ppo"], **{**DEFAULTS, **args})
    torch.testing.assert_close(none.rewards, torch.tensor([[0.0, 1.0]]))
    torch.testing.assert_close(reward.rewards, torch.tensor([[-0.1, 1.0 - 0.05]]))
    cfg = Step3Config(actor_model_name_or_path="a", data_path="d", output_dir="o", critic_model_name_or_path="c",
                      kl_placement="loss")
    cfg.validate()
    assert cfg.spec.kl_in_loss and not cfg.spec.kl_in_reward and cfg.kl_estimator == "k3"
    cfg = Step3Config(actor_model_name_or_path="a", data_path="d", output_dir="o", critic_model_name_or_path="c",
                      kl_placement="loss", kl_estimator="k1")
    with pytest.warns(UserWarning, match="k1 in the loss: on the policy's own samples its gradient is 0"):
        cfg.validate()
    with pytest.raises(ConfigError, match="--kl_placement actor: use one of reward, loss, none"):
        Step3Config(actor_model_name_or_path="a", data_path="d", output_dir="o", reward_fn="gsm8k",
                    kl_placement="actor").validate()


def test_registry_rules():
    for spec in ALGOS.values():
        assert spec.advantage in ADVANTAGE_ESTIMATORS, spec
    assert ALGOS["ppo"].needs_critic and ALGOS["ppo"].kl_in_reward and not ALGOS["ppo"].kl_in_loss
    assert ALGOS["grpo"].kl_in_loss and not ALGOS["grpo"].kl_in_reward
    assert (ALGOS["dr_grpo"].scale_rewards, ALGOS["dr_grpo"].loss_agg) == ("none", "seq_mean_token_sum_norm")
    assert not ALGOS["dapo"].kl_in_loss and not ALGOS["dapo"].kl_in_reward and ALGOS["dapo"].clip_eps == (0.2, 0.28)
    with pytest.raises(ValueError, match="no advantage estimator 'nope'"):
        AlgoSpec(name="x", advantage="nope")
    with pytest.raises(ValueError, match="registered twice"):
        register_advantage("grpo")(lambda spec, x: None)
    with pytest.raises(TypeError):
        AlgoSpec("x", "grpo")  # keywords only


@pytest.mark.parametrize("algo,flags,expected", [
    ("ppo", {}, (0.2, 0.2)),
    ("ppo", {"cliprange": 0.3}, (0.3, 0.3)),
    ("dapo", {}, (0.2, 0.28)),  # DAPO's own clip-higher
    ("dapo", {"cliprange": 0.3}, (0.2, 0.28)),
    ("dapo", {"clip_eps_high": 0.25}, (0.2, 0.25)),
    ("grpo", {"clip_eps_low": 0.1}, (0.1, 0.2)),
    ("grpo", {"policy_loss": "gspo"}, (3e-4, 4e-4)),  # GSPO's sequence-ratio range
    ("dapo", {"policy_loss": "gspo_token", "clip_eps_high": 1e-3}, (3e-4, 1e-3)),
])
def test_clip_range_defaults(algo, flags, expected):
    assert Step3Config(algo=algo, **flags).clip_eps == expected


@pytest.mark.parametrize("flags,updates,from_training,packed", [
    ({"algo": "grpo", "n_samples_per_prompt": 4, "per_device_generation_batch_size": 2, "per_device_training_batch_size": 8},
     1, True, 4),  # one update: old logprobs from it, packed
    ({"algo": "grpo", "n_samples_per_prompt": 4, "per_device_generation_batch_size": 2, "per_device_training_batch_size": 4},
     2, False, 4),  # two whole-group mini-batches
    ({"algo": "grpo", "n_samples_per_prompt": 4, "per_device_generation_batch_size": 2, "per_device_training_batch_size": 2},
     4, False, 1),  # G does not divide the mini-batch: nothing packed
    ({"algo": "rloo", "n_samples_per_prompt": 2, "per_device_generation_batch_size": 2, "per_device_training_batch_size": 4},
     1, False, 2),  # the KL is in the reward: the advantages need the old logprobs before training
    ({"algo": "grpo", "n_samples_per_prompt": 4, "per_device_generation_batch_size": 2, "per_device_training_batch_size": 8,
      "ppo_epochs": 2}, 2, False, 4),
    ({"algo": "grpo", "n_samples_per_prompt": 4, "per_device_generation_batch_size": 2, "per_device_training_batch_size": 8,
      "pack_groups": False}, 1, True, 1),
])
def test_derived_update_plan(flags, updates, from_training, packed):
    cfg = Step3Config(**flags)
    assert (cfg.updates_per_step, cfg.old_logprobs_from_training, cfg.packed_group_size) == (updates, from_training, packed)


def test_total_steps():
    cfg = Step3Config(generation_batches=2, num_train_epochs=3)
    assert cfg.total_steps(10) == 3 * (10 // 2)
    assert Step3Config(max_steps=4, num_train_epochs=3).total_steps(10) == 4
    assert Step3Config(generation_batches=4).total_steps(2) == 1  # at least one step an epoch
