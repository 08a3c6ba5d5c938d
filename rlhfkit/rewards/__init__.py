"""Reward sources: the reward-model scorer and (later) rule-based scorers."""

from rlhfkit.rewards.reward_model import pair_metrics, score_pairs

__all__ = ["pair_metrics", "score_pairs"]
