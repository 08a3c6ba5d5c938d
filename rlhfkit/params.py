"""A model's weights as each rank holds them (its ZeRO-3 partition, or the whole tensor under ZeRO
0-2): a moving average of them and a checksum of them, without gathering the full model."""

from __future__ import annotations

import contextlib

import torch

from rlhfkit import distributed as dist


def local_tensor(p: torch.nn.Parameter) -> torch.Tensor:
    """The part of ``p`` this rank owns: its ZeRO-3 partition, else the whole tensor."""
    return p.ds_tensor if hasattr(p, "ds_tensor") else p.data


class ParamEMA:
    """Exponential moving average of a model's weights, kept per rank on what the rank owns (the
    ZeRO-3 partition, or the full tensor under ZeRO 0-2), in fp32; ``swapped()`` puts the average
    into the model for an export and restores the trained weights afterwards."""

    def __init__(self, module: torch.nn.Module, beta: float):
        self.beta = beta
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.shadow = [local_tensor(p).detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        from rlhfkit.algos import ema_update_

        ema_update_(self.shadow, [local_tensor(p).float() for p in self.params], self.beta)

    def state_dict(self) -> dict:
        return {"beta": self.beta, "shadow": [s.clone() for s in self.shadow]}

    def load_state_dict(self, state: dict) -> None:
        for s, v in zip(self.shadow, state["shadow"]):
            s.copy_(v)

    @contextlib.contextmanager
    def swapped(self):
        backup = [local_tensor(p).detach().clone() for p in self.params]
        try:
            for p, s in zip(self.params, self.shadow):
                local_tensor(p).copy_(s.to(local_tensor(p).dtype))
            yield
        finally:
            for p, b in zip(self.params, backup):
                local_tensor(p).copy_(b)


@torch.no_grad()
def param_fingerprint(module: torch.nn.Module) -> float:
    """A cheap checksum of a (possibly ZeRO-3 partitioned) model's weights: the sum over ranks of
    each rank's owned elements (weighted by position so that permutations show). Collective."""
    total = torch.zeros((), dtype=torch.float64)
    for i, p in enumerate(module.parameters()):
        total += local_tensor(p).double().sum().cpu() * (1.0 + (i % 7) / 7.0)
    if any(hasattr(p, "ds_tensor") for p in module.parameters()):
        total = dist.all_reduce_sum(total)
    return float(total)
