"""All the RLHF math as small pure tensor functions (DESIGN section 6).

No config objects and no torch.distributed in here: callers pass global counts / statistics in.
Shapes: B batch, T full sequence, A response (action) tokens; ``mask`` [B, A] is 1 over the
response up to and including EOS, 0 after.
"""

from .advantages import (
    REWARD_SCALES,
    floor_empty_scores,
    gae_advantages,
    group_advantages,
    lowest_real_score,
    overlong_penalty,
    reinforce_pp_returns,
)
from .controllers import AdaptiveKLController, FixedKLController, RunningMoments, ema_update_
from .kl import kl_estimate, kl_penalized_rewards
from .losses import (
    IGNORE_INDEX,
    aggregate_loss,
    clipped_value_loss,
    dpo_loss,
    gspo_policy_loss,
    kl_loss,
    pairwise_loss,
    ppo_policy_loss,
    sft_loss,
    simpo_loss,
    kto_loss,
)
from .stats import (
    entropy_from_logits,
    explained_variance,
    gather_last_real,
    last_real_token_index,
    logprobs_from_logits,
    masked_mean,
    masked_moments,
    masked_sum,
    masked_var,
    masked_whiten,
    mean_var_from_moments,
)

__all__ = [
    # stats
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "masked_moments",
    "mean_var_from_moments",
    "logprobs_from_logits",
    "entropy_from_logits",
    "explained_variance",
    "last_real_token_index",
    "gather_last_real",
    # kl / rewards
    "kl_estimate",
    "kl_penalized_rewards",
    # advantages
    "gae_advantages",
    "group_advantages",
    "reinforce_pp_returns",
    "overlong_penalty",
    "lowest_real_score",
    "floor_empty_scores",
    "REWARD_SCALES",
    # losses
    "IGNORE_INDEX",
    "aggregate_loss",
    "ppo_policy_loss",
    "gspo_policy_loss",
    "clipped_value_loss",
    "kl_loss",
    "pairwise_loss",
    "sft_loss",
    "dpo_loss",
    "simpo_loss",
    "kto_loss",
    # controllers / EMA
    "FixedKLController",
    "AdaptiveKLController",
    "RunningMoments",
    "ema_update_",
]
