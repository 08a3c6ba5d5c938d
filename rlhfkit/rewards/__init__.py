"""Reward sources: the reward-model scorer and rule-based scorers."""

from rlhfkit.rewards.components import RewardFunctions, parse_reward_spec
from rlhfkit.rewards.reward_model import (SOURCE_FIGURES, by_source, held_out_baselines, pair_metrics, pair_metrics_by_source,
                                         score_pairs, source_tags)
from rlhfkit.rewards.rules import call_reward_fn, extract_answer, gsm8k_parts, gsm8k_reward, load_reward_fn

__all__ = ["RewardFunctions", "parse_reward_spec", "call_reward_fn", "extract_answer", "gsm8k_parts", "gsm8k_reward", "load_reward_fn", "SOURCE_FIGURES", "by_source", "held_out_baselines", "pair_metrics", "pair_metrics_by_source", "score_pairs", "source_tags"]
