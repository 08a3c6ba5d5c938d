"""KL-coefficient controllers, the running reward moments and the EMA update.

Sources: Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences", Sec. 2.2) and
TRL / verl ``AdaptiveKLController`` / ``FixedKLController``; the EMA as in DeepSpeed-Chat
``moving_average``; the running moments as TRL's ``RunningMoments`` (Chan et al.'s parallel update).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["FixedKLController", "AdaptiveKLController", "RunningMoments", "ema_update_"]


class FixedKLController:
    """Constant KL coefficient: ``.value`` never changes; ``update`` is a no-op."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl, n_steps: int) -> None:
        """No-op (kept for the same interface as :class:`AdaptiveKLController`)."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019).

      e      = clip(current_kl / target_kl - 1, -0.2, 0.2)
      value *= 1 + e * n_steps / horizon
    ``current_kl`` is the measured KL of the last batch (float or 0-d tensor), ``n_steps`` the
    number of samples (or steps) it covered, as in TRL / verl.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0, got {target_kl}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl, n_steps: int) -> None:
        current = float(current_kl)
        proportional_error = min(max(current / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))


class RunningMoments:
    """Mean and (population) variance of every value seen so far, updated a batch at a time from the
    batch's sum, sum of squares and count (:func:`rlhfkit.algos.masked_moments`; a batch may be spread
    over ranks: pass the global sums):

      delta = batch_mean - mean,  total = count + n
      mean += delta * n / total
      var   = (var * count + batch_var * n + delta^2 * count * n / total) / total

    ``normalize(x)`` = (x - mean) / sqrt(var + eps): reward normalisation (TRL's score scaling, OpenRLHF's
    ``--normalize_reward``), so the reward's scale, not the reward model's, meets the KL coefficient.
    """

    def __init__(self, eps: float = 1e-8):
        self.count, self.mean, self.var, self.eps = 0.0, 0.0, 1.0, eps

    def update(self, total: float, total_sq: float, n: float) -> None:
        if n <= 0:
            return
        batch_mean = total / n
        batch_var = max(total_sq / n - batch_mean ** 2, 0.0)
        delta, new_count = batch_mean - self.mean, self.count + n
        var = (self.var * self.count + batch_var * n + delta ** 2 * self.count * n / new_count) / new_count
        self.mean, self.var, self.count = self.mean + delta * n / new_count, var, new_count

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / (self.var + self.eps) ** 0.5

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "var": self.var}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.var = float(state["count"]), float(state["mean"]), float(state["var"])


@torch.no_grad()
def ema_update_(ema_tensors: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], beta: float) -> None:
    """In place, for each pair: ema = beta * ema + (1 - beta) * x (DeepSpeed-Chat ``moving_average``).

    ``ema_tensors`` and ``tensors`` are equally long sequences of same-shaped tensors (e.g. the
    EMA actor's and the actor's parameters, already gathered under ZeRO-3 by the caller).
    """
    ema_tensors, tensors = list(ema_tensors), list(tensors)
    if len(ema_tensors) != len(tensors):
        raise ValueError(f"{len(ema_tensors)} EMA tensors for {len(tensors)} tensors")
    for e, x in zip(ema_tensors, tensors):
        e.lerp_(x.to(device=e.device, dtype=e.dtype), 1.0 - beta)
