"""``--fit_head_only``: the reward model's body stays frozen and its score head is fitted exactly.

Every training pair goes through the model once (by default packed, as training packs it: its prompt
computed once); what the score head reads for each side (the final hidden state at the last real
token) is kept, and the head is the L2-regularised Bradley-Terry fit on those features
(:func:`rlhfkit.algos.linear_head.fit_linear_bt_head`, the L2 strength by cross-validation on the
training pairs). It costs one forward pass over the training pairs and no backward pass, and it is
the optimum of the head-only objective rather than a few noisy Adam steps.
The fitted head is written into the model, so the held-out evaluation and the checkpoint are those of
the real model. The body being frozen, the fresh head's held-out accuracy ("before") is read from the
same held-out forward pass as the fitted one's.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from rlhfkit import distributed as dist
from rlhfkit.algos.linear_head import fit_linear_bt_head
from rlhfkit.loaders import feature_length
from rlhfkit.models import head_inputs_at_last_token, packed_pair_head_inputs, score_head
from rlhfkit.supervised import LoopResult


def rank_batches(pairs: list[dict], batch_size: int) -> list[list[int]]:
    """This rank's batches of pair indices: the pairs sorted by length (little padding) and dealt to the
    ranks in turn; every rank gets the same number of batches, short ones padded with -1 (no pair)."""
    order = sorted(range(len(pairs)), key=lambda i: feature_length(pairs[i]))
    world, rank = dist.world_size(), dist.rank()
    per_rank = -(-len(order) // world)
    mine = order[rank::world] + [-1] * (per_rank - len(order[rank::world]))
    return [mine[s:s + batch_size] for s in range(0, len(mine), batch_size)]


@torch.no_grad()
def pair_head_inputs(engine: Any, pairs: list[dict], collate: Callable, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [N, H], rejected [N, H]): the score head's inputs of every pair of ``pairs``, in order, on
    every rank (each rank runs its share). ``collate``: ``collate_pairs`` (chosen rows then rejected rows)
    or ``collate_packed_pairs`` (one row per pair, its prompt computed once)."""
    engine.eval()
    mine: list[tuple[int, torch.Tensor]] = []
    for idx in rank_batches(pairs, batch_size):
        batch = {k: v.to(engine.device) for k, v in collate([pairs[i] if i >= 0 else pairs[0] for i in idx]).items()}
        if "pair_mask" in batch:  # packed pairs
            chosen, rejected = (h.cpu() for h in packed_pair_head_inputs(engine, batch))
        else:
            chosen, rejected = head_inputs_at_last_token(engine, batch["input_ids"], batch["attention_mask"]).cpu().chunk(2)
        mine += [(i, torch.stack([chosen[k], rejected[k]])) for k, i in enumerate(idx) if i >= 0]
    rows = dict(dist.gather_lists(mine))
    both = torch.stack([rows[i] for i in range(len(pairs))])  # [N, 2, H]
    return both[:, 0], both[:, 1]


@torch.no_grad()
def install_head(engine: Any, weight: torch.Tensor) -> None:
    """Set the score head's weight [1, H] to ``weight`` [H] (and a bias, if the head has one, to 0), on
    the full parameter even when ZeRO-3 partitions it."""
    import deepspeed

    head = score_head(engine)
    params = list(head.parameters())
    partitioned = any(hasattr(p, "ds_id") for p in params)
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=partitioned):
        if dist.is_main() or not partitioned:
            head.weight.copy_(weight.to(head.weight.dtype).view_as(head.weight))
            if getattr(head, "bias", None) is not None:
                head.bias.zero_()


@torch.no_grad()
def copy_of_head(engine: Any) -> torch.nn.Linear:
    """A plain fp32 copy (on the CPU) of the score head as it is now, gathered when ZeRO-3 partitions it."""
    import deepspeed

    head = score_head(engine)
    params = list(head.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=any(hasattr(p, "ds_id") for p in params)):
        weight = head.weight.detach().float().cpu().view(1, -1)
        bias = head.bias.detach().float().cpu().view(1) if getattr(head, "bias", None) is not None else None
    copy = torch.nn.Linear(weight.shape[1], 1, bias=bias is not None)
    copy.weight.copy_(weight)
    if bias is not None:
        copy.bias.copy_(bias)
    return copy


def fit_head(engine: Any, train_set: list[dict], collate: Callable, batch_size: int, logger: Any, seed: int,
             evaluate_beside: Callable[[torch.nn.Module], tuple[dict, dict]]) -> tuple[LoopResult, dict]:
    """Fit the head on the training pairs' features (batched by ``collate``: two rows or one packed row a
    pair) and install it; then one pass over the held-out pairs evaluates the model (the fitted head) and,
    from the same features, the fresh head it replaced (``evaluate_beside(head) -> (model's, head's)``).
    -> (a LoopResult of 0 optimiser steps whose evals are before and after, the fit's report)."""
    res = LoopResult()
    t0 = time.time()
    fresh = copy_of_head(engine)
    chosen, rejected = pair_head_inputs(engine, train_set, collate, batch_size)
    t_features = time.time() - t0
    weight, report = fit_linear_bt_head(chosen, rejected, seed=seed)
    install_head(engine, weight)
    dist.print_rank0(f"head fitted on {len(train_set)} pairs' features ({t_features:.0f} s): l2 {report['l2']:g}, "
                     f"cross-validated accuracy {report['cv_accuracy'][report['l2']]:.3f}, "
                     f"training accuracy {report['train_accuracy']:.3f}")
    after, before = evaluate_beside(fresh)
    res.evals += [{"step": 0, **before}, {"step": 1, **after}]
    res.steps, res.samples, res.seconds = 1, 2 * len(train_set), time.time() - t0
    logger.log(0, {f"eval/{k}": v for k, v in before.items()})
    logger.log(1, {"train/cv_accuracy": report["cv_accuracy"][report["l2"]], "train/accuracy": report["train_accuracy"],
                   "train/l2": report["l2"], **{f"eval/{k}": v for k, v in after.items()}})
    return res, {"head_fit_l2": report["l2"], "head_fit_cv_accuracy": report["cv_accuracy"][report["l2"]],
                 "head_fit_train_accuracy": report["train_accuracy"]}
