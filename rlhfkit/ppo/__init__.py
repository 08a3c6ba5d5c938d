"""Step 3's PPO loop in parts, each a module-level function or small class that
``step3_ppo/main.py`` composes: build the models (:mod:`.models`), roll out and score
(:mod:`.collect`), compute advantages and update (:mod:`.update`), evaluate and log (:mod:`.evaluate`).
The math itself is in :mod:`rlhfkit.algos` and the algorithm registry in :mod:`rlhfkit.rl`."""

from rlhfkit.ppo.collect import Collected, ExperienceMaker, part_means
from rlhfkit.ppo.evaluate import HeldOutEval, step_metrics
from rlhfkit.ppo.models import PPOModels, build_models, load_frozen, load_trained
from rlhfkit.ppo.update import Trainables, UpdateSettings, UpdateStats, add_advantages, mean_metrics, ppo_update, train_on

__all__ = [
    "Collected", "ExperienceMaker", "HeldOutEval", "PPOModels", "Trainables", "UpdateSettings", "UpdateStats", "add_advantages",
    "build_models", "load_frozen", "load_trained", "mean_metrics", "part_means", "ppo_update", "step_metrics", "train_on",
]
