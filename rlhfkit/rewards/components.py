"""Several rule rewards at once: ``--reward_fn NAME[:WEIGHT]`` repeated, each a component with its weight;
``--reward_url URL[:WEIGHT]`` adds reward servers as components of the same kind.

The weight is parsed from the last colon when what follows it is a number, so ``gsm8k:1.0``,
``mymod:len_penalty:0.2`` and today's ``mymod:len_penalty`` (weight ``--reward_fn_weight``) all read.
Each component can be normalised by the running mean and std of its own scores so far (all ranks)
before it is weighted (``--normalize_reward_fns``), so that weights compare components on one scale.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from rlhfkit.algos import RunningMoments, masked_moments
from rlhfkit.errors import ConfigError
from rlhfkit.rewards.rules import RewardFn, call_reward_fn, load_reward_fn


def parse_reward_spec(spec: str, default_weight: float) -> tuple[str, float]:
    """``"name:0.5"`` -> ("name", 0.5); ``"pkg.mod:fn"`` -> ("pkg.mod:fn", default_weight)."""
    head, sep, tail = spec.rpartition(":")
    if sep and head:
        try:
            return head, float(tail)
        except ValueError:
            pass
    return spec, default_weight


@dataclass
class RewardComponent:
    name: str  # gsm8k, or module.path:function
    fn: RewardFn
    weight: float
    norm: Optional[RunningMoments] = None  # its running moments, with --normalize_reward_fns


@dataclass
class RewardFunctions:
    """The rule-reward components of a run: ``score(...)`` -> their weighted sum per sample."""

    components: list[RewardComponent] = field(default_factory=list)

    @staticmethod
    def load(specs: list[str], default_weight: float = 1.0, normalize: bool = False, urls: Sequence[str] = (),
             url_timeout: float = 60.0, url_retries: int = 3) -> "RewardFunctions":
        """The ``--reward_fn`` specs, then the ``--reward_url`` ones (:mod:`rlhfkit.rewards.remote`)."""
        from rlhfkit.rewards.remote import RemoteReward, parse_url_spec

        parsed = [parse_reward_spec(s, default_weight) for s in specs]
        parsed_urls = [parse_url_spec(u, default_weight) for u in urls]
        names = [n for n, _ in parsed + parsed_urls]
        if len(set(names)) != len(names):
            raise ConfigError(f"--reward_fn/--reward_url names a source twice ({', '.join([*specs, *urls])}): give each "
                              "once, with its weight")
        fns = [load_reward_fn(n) for n, _ in parsed] + [RemoteReward(u, url_timeout, url_retries) for u, _ in parsed_urls]
        return RewardFunctions([RewardComponent(n, fn, w, RunningMoments() if normalize else None)
                                for (n, w), fn in zip(parsed + parsed_urls, fns)])

    def __bool__(self) -> bool:
        return bool(self.components)

    def score(self, prompts: list, responses: list, rows: list, parts: dict[str, list], device: Any,
              all_reduce_sum: Callable[[torch.Tensor], torch.Tensor], training: bool = True,
              gsm8k_kwargs: Optional[dict] = None, messages: Optional[list] = None) -> torch.Tensor:
        """[B] on ``device``: sum_c weight_c * score_c (each normalised first with --normalize_reward_fns; only
        ``training`` batches update the running moments, every rank calling this the same number of times). Per
        component, ``parts["fn/<name>"]`` gets its scores as returned and ``parts["fn/<name>/weighted"]`` what it
        added to the reward; the gsm8k reward adds its accuracy and format parts too. ``messages`` (each sample's
        prompt turns) go to the components that want them: the reward servers."""
        total = torch.zeros(len(responses), dtype=torch.float32, device=device)
        for c in self.components:
            extra = {**(gsm8k_kwargs or {}), "parts": parts} if c.name == "gsm8k" else {}
            if getattr(c.fn, "wants_messages", False):
                extra["messages"] = messages
            raw = torch.tensor(call_reward_fn(c.name, c.fn, prompts, responses, rows, **extra), dtype=torch.float32,
                               device=device)
            scores = raw
            if c.norm is not None:
                if training:
                    c.norm.update(*all_reduce_sum(masked_moments(raw.double(), torch.ones_like(raw))).tolist())
                scores = c.norm.normalize(raw)
            weighted = c.weight * scores
            parts.setdefault(f"fn/{c.name}", []).extend(raw.tolist())
            parts.setdefault(f"fn/{c.name}/weighted", []).extend(weighted.tolist())
            total += weighted
        return total

    def state_dict(self) -> dict:
        return {c.name: c.norm.state_dict() for c in self.components if c.norm is not None}

    def load_state_dict(self, state: dict) -> None:
        for c in self.components:
            if c.norm is not None:
                c.norm.load_state_dict(state[c.name])
