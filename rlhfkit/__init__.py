"""rlhfkit: a DeepSpeed-based RLHF pipeline (SFT -> reward model -> PPO and relatives)."""

__version__ = "0.1.0"
