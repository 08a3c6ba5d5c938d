"""Shared training machinery for the programs: the entry wrapper, DeepSpeed engines, data loaders,
the supervised loop (steps 1, 2 and DPO) and the end-of-run summary.

The programs keep only what is theirs (which models, which loss); everything here is the same for
all of them, so it is written once.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from rlhfkit import distributed as dist
from rlhfkit.ds_config import BatchPlan, train_config
from rlhfkit.errors import ConfigError, RlhfkitError
from rlhfkit.models.cpu_bf16 import fp32_products


# ----------------------------------------------------------------------------------------------
# entry point


def run_main(main: Callable[[], Any]) -> None:
    """Run a program's ``main``: user errors print one message (no traceback) and exit with status 2."""
    try:
        main()
    except RlhfkitError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
    except Exception as e:  # a peer rank died or hung: say so in one line instead of a gloo/NCCL stack
        if dist.world_size() > 1 and _is_collective_failure(e):
            print(f"error: rank {dist.rank()} of {dist.world_size()}: a collective operation failed, so another rank died, "
                  f"was killed or stopped answering (timeout --dist_timeout_s); stopping. ({type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200]})", file=sys.stderr, flush=True)
            dist.remove_shm_buffers()
            os._exit(3)
        raise


def _is_collective_failure(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}"
    return any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "gloo", "NCCL", "DistBackendError",
                                   "timed out", "Timeout", "DistNetworkError", "Broken pipe"))


def silence_libraries() -> None:
    """Keep library chatter out of the programs' output (warnings stay visible on rank 0)."""
    import logging
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except Exception:  # noqa: BLE001 - cosmetic
        pass
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*torch.distributed.*deprecated.*")
    if not dist.is_main():
        warnings.filterwarnings("ignore")


# ----------------------------------------------------------------------------------------------
# data loading


class ListDataset(Dataset):
    def __init__(self, items: Sequence[Any]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


class LengthGroupedSampler(torch.utils.data.Sampler):
    """Shuffled, sharded batches of similar length (HF Trainer's ``group_by_length``, made
    distributed): each epoch the rows are shuffled with ``seed + epoch``, cut into mega-batches of
    ``mega`` global batches, each sorted by length and cut into global batches, whose order is shuffled
    again; rank r takes its slice of every global batch. Padding shrinks to the length spread inside a
    batch, every rank gets the same number of rows (the tail wraps around), and the same-step ranks
    see similar lengths, so ZeRO-3 ranks wait less for each other."""

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int, mega: int = 16):
        self.lengths, self.batch_size, self.seed, self.mega = list(lengths), batch_size, seed, mega
        self.world, self.rank, self.epoch = dist.world_size(), dist.rank(), 0
        self.global_batch = batch_size * self.world
        self.num_batches = max(1, math.ceil(len(self.lengths) / self.global_batch))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_batches * self.batch_size

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        total = self.num_batches * self.global_batch
        order = (order * math.ceil(total / max(len(order), 1)))[:total]
        batches = []
        span = self.global_batch * self.mega
        for start in range(0, total, span):
            chunk = sorted(order[start:start + span], key=lambda i: self.lengths[i], reverse=True)
            batches += [chunk[i:i + self.global_batch] for i in range(0, len(chunk), self.global_batch)]
        for b in torch.randperm(len(batches), generator=g).tolist():
            yield from batches[b][self.rank * self.batch_size:(self.rank + 1) * self.batch_size]


def train_loader(features: Sequence[Any], collate: Callable, batch_size: int, seed: int,
                 lengths: Optional[Sequence[int]] = None) -> DataLoader:
    """A shuffled loader sharded over ranks; every rank gets the same number of batches (ZeRO-3
    needs all ranks in every forward pass), deterministic for a seed (call ``set_epoch``). With
    ``lengths``, batches group rows of similar length (less padding, same rows per epoch)."""
    if lengths is not None:
        sampler = LengthGroupedSampler(lengths, batch_size, seed)
    else:
        sampler = DistributedSampler(ListDataset(features), num_replicas=dist.world_size(), rank=dist.rank(), shuffle=True,
                                     seed=seed, drop_last=False)
    # Its own generator: a DataLoader otherwise draws a seed from the global RNG each time an epoch
    # starts, which would make sampling after a resume differ from the uninterrupted run.
    return DataLoader(ListDataset(features), batch_size=batch_size, sampler=sampler, collate_fn=collate, drop_last=False,
                      generator=torch.Generator().manual_seed(seed))


def eval_batches(features: Sequence[Any], collate: Callable, batch_size: int) -> Iterable[tuple[Any, torch.Tensor]]:
    """This rank's evaluation batches with a 0/1 weight per row: the set is padded (with weight 0
    copies) so that every rank runs the same number of batches and no row counts twice."""
    n, world, r = len(features), dist.world_size(), dist.rank()
    per_rank = math.ceil(n / world)
    per_rank = math.ceil(per_rank / batch_size) * batch_size
    idx = list(range(r * per_rank, (r + 1) * per_rank))
    for start in range(0, len(idx), batch_size):
        chunk = idx[start:start + batch_size]
        rows = [features[i] if i < n else features[0] for i in chunk]
        weights = torch.tensor([1.0 if i < n else 0.0 for i in chunk])
        yield collate(rows), weights


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}


# ----------------------------------------------------------------------------------------------
# engines


def batch_plan(micro_batch: int, grad_accum: int) -> BatchPlan:
    return BatchPlan(micro_batch=micro_batch, grad_accum=grad_accum, world_size=dist.world_size())


def zero3_block_leaves(model: torch.nn.Module) -> list[type]:
    """Make ZeRO-3 gather, release and reduce each transformer block as one unit (DeepSpeed "leaf
    modules"; the granularity at which FSDP wraps a model), not each linear layer inside it.

    The blocks are the model's ``_no_split_modules`` (transformers' own list, which its FSDP
    integration also wraps). Same parameters, same gradients, far fewer hooks and collectives: a
    2-rank ZeRO-3 step of step 2 on SmolLM2-135M on the CPU went from 5.9 to 4.0 s with identical
    losses. Returns the classes made leaves (none for a model without the list)."""
    from deepspeed.utils import set_z3_leaf_modules

    names = set()
    for m in model.modules():  # peft and DeepSpeed wrappers: the list sits on the transformers model
        names.update(getattr(m, "_no_split_modules", None) or [])
    classes = list({type(m) for m in model.modules() if type(m).__name__ in names})
    if classes:
        set_z3_leaf_modules(model, classes)
    return classes


def build_engine(model: torch.nn.Module, *, plan: BatchPlan, zero_stage: int, dtype: str, offload: bool,
                 learning_rate: float, weight_decay: float, betas: tuple[float, float], gradient_clipping: float,
                 lr_scheduler_type: str, num_warmup_steps: int, total_steps: int,
                 lora_learning_rate: Optional[float] = None, hybrid_engine: Optional[dict] = None, block_leaves: bool = True):
    """Wrap a model in a DeepSpeed training engine with AdamW and a warm-up schedule (under ZeRO-3 with
    ``block_leaves``, each transformer block gathered as one unit: :func:`zero3_block_leaves`)."""
    import deepspeed
    from transformers import get_scheduler

    from rlhfkit.models import param_groups

    on_cuda = dist.on_cuda()
    cfg = train_config(plan=plan, zero_stage=zero_stage, dtype=dtype, offload=offload, gradient_clipping=gradient_clipping,
                       on_cuda=on_cuda, hybrid_engine=hybrid_engine)
    groups = param_groups(model, weight_decay, learning_rate, lora_learning_rate)
    if not groups:
        raise ConfigError("no trainable parameters (check --only_optimize_lora / --lora_dim)")
    # torch's fused AdamW (one kernel over all tensors) on CUDA and CPU alike: on the CPU it takes
    # 0.1 s of a 2-rank ZeRO-3 step on 135M where the per-tensor loop took 0.5 s
    optimizer = torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=1e-8, fused=True)

    def scheduler(opt):
        return get_scheduler(lr_scheduler_type, optimizer=opt, num_warmup_steps=num_warmup_steps,
                             num_training_steps=max(total_steps, 1))

    if zero_stage == 3 and hybrid_engine is None and block_leaves:
        leaves = zero3_block_leaves(model)
        dist.print_rank0(f"ZeRO-3 gathers each {', '.join(c.__name__ for c in leaves)} as one unit" if leaves else
                         "ZeRO-3 gathers parameters module by module (the model lists no transformer block classes)")
    fp32_products(model)  # heads and LoRA layers added after loading too
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=cfg)
    if zero_stage == 0 and engine.dp_world_size == 1:
        # One data-parallel rank: nothing to average, yet DeepSpeed would flatten, "all-reduce" and copy
        # back every gradient after each backward (0.2 s of a bf16 step on 135M on the CPU). Same bits without.
        engine.enable_backward_allreduce = False
    return engine


def build_frozen_engine(model: torch.nn.Module, *, zero_stage: int, dtype: str, offload: bool, micro_batch: int,
                        block_leaves: bool = True):
    """A frozen model (reference, reward) as a DeepSpeed inference engine: ZeRO-3 shards it."""
    import deepspeed

    from rlhfkit.ds_config import eval_config

    model.requires_grad_(False)
    model.eval()
    cfg = eval_config(micro_batch=micro_batch, world_size=dist.world_size(), zero_stage=zero_stage, dtype=dtype, offload=offload)
    if zero_stage == 3 and block_leaves:
        zero3_block_leaves(model)
    fp32_products(model)
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    engine.eval()
    return engine


def count_steps(n_batches_per_epoch: int, grad_accum: int, epochs: int, max_steps: Optional[int]) -> int:
    """Optimiser steps of a run: ceil(batches / grad_accum) per epoch, capped by ``max_steps``."""
    per_epoch = max(1, n_batches_per_epoch // grad_accum)
    total = per_epoch * epochs
    return min(total, max_steps) if max_steps else total


# ----------------------------------------------------------------------------------------------
# the supervised loop (steps 1, 2, DPO)


@dataclass
class LoopResult:
    steps: int = 0
    samples: int = 0  # training sequences seen, all ranks
    tokens: int = 0  # real (non-pad) training tokens, all ranks
    seconds: float = 0.0
    evals: list[dict] = field(default_factory=list)  # (step, metrics) of each evaluation
    last_train: dict = field(default_factory=dict)
    nonfinite_skipped: int = 0  # updates skipped for a NaN/Inf loss


def nonfinite_injected(counter: int) -> bool:
    """Fault injection for tests: ``RLHFKIT_FAULT_NAN_AT=3,4`` makes the 3rd and 4th loss (counted from 1
    in this process) NaN, so the skip-and-stop path runs through the real program."""
    spec = os.environ.get("RLHFKIT_FAULT_NAN_AT", "")
    return bool(spec) and str(counter) in spec.split(",")


class NonFiniteGuard:
    """Skips updates whose loss is NaN/Inf on any rank (all ranks skip together), counts them, and
    stops the run after ``max_consecutive`` in a row."""

    def __init__(self, max_consecutive: int, last_state: Callable[[], Any]):
        self.max_consecutive = max_consecutive
        self.last_state = last_state
        self.total = 0
        self.consecutive = 0
        self.seen = 0

    def ok(self, loss: torch.Tensor) -> bool:
        self.seen += 1
        bad = (not torch.isfinite(loss.detach()).all().item()) or nonfinite_injected(self.seen)
        if dist.all_reduce_sum(torch.tensor([float(bad)], device=loss.device)).item() == 0:
            self.consecutive = 0
            return True
        self.total += 1
        self.consecutive += 1
        dist.print_rank0(f"[nonfinite] loss is NaN/Inf: update skipped ({self.consecutive} in a row, {self.total} in all)")
        if self.consecutive >= self.max_consecutive:
            where = self.last_state()
            raise RlhfkitError(f"{self.consecutive} consecutive non-finite losses (--max_nonfinite_steps {self.max_consecutive}); "
                               f"stopped. Last good training state: {where or 'none saved (set --save_interval)'}; "
                               "lower the learning rate or check the data, then --resume")
        return False


def fit(
    engine,
    loader: DataLoader,
    *,
    compute_loss: Callable[[dict], tuple[torch.Tensor, dict]],
    evaluate: Callable[[], dict],
    total_steps: int,
    epochs: int,
    grad_accum: int,
    eval_interval: int,
    log_interval: int,
    logger,
    program: str,
    progress_bar: bool = True,
    run_state: Optional[Any] = None,
    max_nonfinite_steps: int = 10,
    sequences_per_row: int = 1,
) -> LoopResult:
    """Train ``engine`` over ``loader`` for ``total_steps`` optimiser steps (or the epochs).

    ``compute_loss(batch) -> (loss, stats)`` runs the forward pass; stats are python floats averaged
    over ranks and micro-batches for logging. ``evaluate() -> metrics`` runs before training, every
    ``eval_interval`` steps and at the end. With ``run_state`` (:class:`rlhfkit.resume.RunState`) the
    loop resumes from a saved state (same data order: the sampler is reseeded per epoch and the
    batches already trained on are skipped) and saves one every ``save_interval`` steps.
    ``sequences_per_row``: how many training sequences a batch row holds (2 for a packed pair), for
    the samples count.
    """
    from tqdm import tqdm

    res = LoopResult()
    dev = engine.device
    start_epoch, skip = 0, 0
    restored = run_state.restore() if run_state is not None else None
    if restored:
        c = restored["counters"]
        res.steps, res.samples, res.tokens = c["step"], c["samples"], c["tokens"]
        start_epoch, skip = c["epoch"], c["batch_in_epoch"]
        res.evals = restored["extra"].get("evals", [])
    else:
        ev = evaluate()
        res.evals.append({"step": 0, **ev})
        logger.log(0, {f"eval/{k}": v for k, v in ev.items()})
    guard = NonFiniteGuard(max_nonfinite_steps, lambda: run_state.last_saved if run_state is not None else None)
    bar = tqdm(total=total_steps, initial=res.steps, desc=program, disable=not (progress_bar and dist.is_main()),
               dynamic_ncols=True, file=sys.stdout)
    t0, samples0, tokens0 = time.time(), res.samples, res.tokens
    acc: dict[str, float] = {}
    n_micro = 0
    engine.train()
    done = res.steps >= total_steps
    for epoch in range(start_epoch, epochs):
        if done:
            break
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        for index, batch in enumerate(loader):
            if epoch == start_epoch and index < skip:
                continue
            batch = to_device(batch, dev)
            loss, stats = compute_loss(batch)
            if not guard.ok(loss):
                continue
            engine.backward(loss)
            crash_point("train_step")
            engine.step()
            n_micro += 1
            for k, v in stats.items():
                acc[k] = acc.get(k, 0.0) + float(v)
            res.samples += int(batch["input_ids"].shape[0]) * sequences_per_row * dist.world_size()
            res.tokens += int(dist.all_reduce_sum(batch["attention_mask"].sum().to(torch.float64)).item()) if "attention_mask" in batch else 0
            if n_micro % grad_accum:
                continue
            res.steps += 1
            bar.update(1)
            if res.steps % log_interval == 0 or res.steps == total_steps:
                means = dist.mean_over_ranks({k: v / n_micro for k, v in acc.items()}, dev)
                elapsed = time.time() - t0
                means.update(lr=engine.get_lr()[0], samples_per_s=(res.samples - samples0) / elapsed,
                             tokens_per_s=(res.tokens - tokens0) / elapsed, samples=res.samples, tokens=res.tokens, epoch=epoch,
                             nonfinite_skipped=guard.total)
                res.last_train = means
                logger.log(res.steps, {f"train/{k}": v for k, v in means.items()}, write=bar.write)
                acc, n_micro = {}, 0
            if eval_interval and res.steps % eval_interval == 0 and res.steps < total_steps:
                ev = evaluate()
                engine.train()
                res.evals.append({"step": res.steps, **ev})
                logger.log(res.steps, {f"eval/{k}": v for k, v in ev.items()}, write=bar.write)
            if run_state is not None and run_state.due(res.steps):
                run_state.save(res.steps, {"epoch": epoch, "batch_in_epoch": index + 1, "samples": res.samples, "tokens": res.tokens},
                               extra={"evals": res.evals})
            if res.steps >= total_steps:
                done = True
                break
    bar.close()
    res.seconds = time.time() - t0
    res.nonfinite_skipped = guard.total
    if not res.evals or res.evals[-1]["step"] != res.steps:
        ev = evaluate()
        res.evals.append({"step": res.steps, **ev})
        logger.log(res.steps, {f"eval/{k}": v for k, v in ev.items()})
    return res


def print_summary(title: str, lines: dict[str, Any]) -> None:
    """The end-of-run summary, rank 0 only."""
    if not dist.is_main():
        return
    width = max(len(k) for k in lines) if lines else 0
    print(f"\n==== {title} ====", flush=True)
    for k, v in lines.items():
        print(f"  {k.ljust(width)}  {v}", flush=True)


class ParamEMA:
    """Exponential moving average of a model's weights, kept per rank on what the rank owns (the
    ZeRO-3 partition, or the full tensor under ZeRO 0-2), in fp32; ``swapped()`` puts the average
    into the model for an export and restores the trained weights afterwards."""

    def __init__(self, module: torch.nn.Module, beta: float):
        self.beta = beta
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.shadow = [self._local(p).detach().float().clone() for p in self.params]

    @staticmethod
    def _local(p: torch.nn.Parameter) -> torch.Tensor:
        return p.ds_tensor if hasattr(p, "ds_tensor") else p.data

    @torch.no_grad()
    def update(self) -> None:
        from rlhfkit.algos import ema_update_

        ema_update_(self.shadow, [self._local(p).float() for p in self.params], self.beta)

    def state_dict(self) -> dict:
        return {"beta": self.beta, "shadow": [s.clone() for s in self.shadow]}

    def load_state_dict(self, state: dict) -> None:
        for s, v in zip(self.shadow, state["shadow"]):
            s.copy_(v)

    @contextlib.contextmanager
    def swapped(self):
        backup = [self._local(p).detach().clone() for p in self.params]
        try:
            for p, s in zip(self.params, self.shadow):
                self._local(p).copy_(s.to(self._local(p).dtype))
            yield
        finally:
            for p, b in zip(self.params, backup):
                self._local(p).copy_(b)


@torch.no_grad()
def param_fingerprint(module: torch.nn.Module) -> float:
    """A cheap checksum of a (possibly ZeRO-3 partitioned) model's weights: the sum over ranks of
    each rank's owned elements (weighted by position so that permutations show). Collective."""
    total = torch.zeros((), dtype=torch.float64)
    for i, p in enumerate(module.parameters()):
        local = p.ds_tensor if hasattr(p, "ds_tensor") else p.data
        total += local.double().sum().cpu() * (1.0 + (i % 7) / 7.0)
    if any(hasattr(p, "ds_tensor") for p in module.parameters()):
        total = dist.all_reduce_sum(total)
    return float(total)


def peak_rss_gb() -> float:
    """Peak resident memory of this process in GiB (CPU), or peak allocated CUDA memory on GPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def make_run_state(cfg: Any, engines: dict[str, Any]):
    """The :class:`rlhfkit.resume.RunState` of a program from its config's resume flags."""
    from rlhfkit.config import config_dict
    from rlhfkit.resume import RunState

    return RunState(cfg.output_dir, engines, config_dict(cfg), save_interval=cfg.save_interval, keep_last_k=cfg.keep_last_k,
                    resume=cfg.resume, allow_config_change=cfg.resume_allow_config_change)


class BatchStream:
    """Endless batches from a sharded loader, reshuffled each epoch, with a position (epoch, index)
    that a training state records and a resumed run continues from."""

    def __init__(self, loader: DataLoader, epoch: int = 0, index: int = 0):
        self.loader, self.epoch, self.index = loader, epoch, index
        self._it: Optional[Iterator] = None

    def __iter__(self) -> "BatchStream":
        return self

    def __next__(self) -> Any:
        while True:
            if self._it is None:
                if hasattr(self.loader.sampler, "set_epoch"):
                    self.loader.sampler.set_epoch(self.epoch)
                self._it = iter(self.loader)
                for _ in range(self.index):  # skip what was already consumed before a resume
                    next(self._it)
            try:
                batch = next(self._it)
            except StopIteration:
                self._it, self.epoch, self.index = None, self.epoch + 1, 0
                continue
            self.index += 1
            return batch

    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}


_CRASH_COUNTS: dict[str, int] = {}


def crash_point(where: str) -> None:
    """Fault injection for tests: ``RLHFKIT_FAULT_KILL=<where>:<n>`` SIGKILLs rank 0 the n-th time it
    reaches ``where`` ("train_step" in the supervised loop, "generation" in step 3's rollouts), so a
    crash mid-run is reproducible."""
    spec = os.environ.get("RLHFKIT_FAULT_KILL", "")
    if not spec or not dist.is_main():
        return
    name, _, n = spec.partition(":")
    if name != where:
        return
    _CRASH_COUNTS[where] = _CRASH_COUNTS.get(where, 0) + 1
    if _CRASH_COUNTS[where] == int(n or 1):
        import signal

        print(f"[fault injection] SIGKILL at {where} #{n}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


# ----------------------------------------------------------------------------------------------
# the set-up the supervised programs (SFT, reward model, DPO) share


def start_program(config_cls: type) -> Any:
    """Parse the program's config, quiet the libraries, join the process group, seed everything."""
    from rlhfkit.config import parse_config

    cfg = parse_config(config_cls)
    silence_libraries()
    dist.init(cfg.dist_timeout_s)
    dist.set_seed(cfg.seed)
    return cfg


def load_split(cfg: Any, *, phase: int, need: str, tokenize: Callable, tokenizer: Any) -> tuple[list, list, list]:
    """This program's share of every data source, tokenised: (train features, eval features, source
    reports), with what was read, skipped and truncated printed on rank 0."""
    from rlhfkit.data import load_phase_data

    train_rows, eval_rows, sources = load_phase_data(cfg.data_path, phase=phase, need=need, data_split=cfg.data_split,
                                                     seed=cfg.seed, eval_fraction=cfg.eval_fraction, strict=cfg.strict,
                                                     max_eval=cfg.max_eval_samples)
    train_set, train_report = tokenize(train_rows, tokenizer, cfg.max_seq_len)
    eval_set, eval_report = tokenize(eval_rows, tokenizer, cfg.max_seq_len)
    for s in sources:
        dist.print_rank0(s.summary())
    dist.print_rank0(f"train: {train_report.summary()}\neval: {eval_report.summary()}")
    return train_set, eval_set, sources


def feature_length(f: dict) -> int:
    """Tokens of one training row (the longer side of a pair)."""
    if "input_ids" in f:
        return len(f["input_ids"])
    return max(len(f["chosen_input_ids"]), len(f["rejected_input_ids"]))


def trainable_engine(cfg: Any, kind: str, *, plan: BatchPlan, total_steps: int, pad_token_id: int,
                     row_len: Optional[int] = None):
    """``cfg.model_name_or_path`` loaded as ``kind`` (partitioned while loading under ZeRO-3), with
    gradient checkpointing and LoRA as configured, wrapped in a DeepSpeed training engine.
    ``row_len``: the longest training row (default ``cfg.max_seq_len``), for the attention choice."""
    from rlhfkit.ds_config import init_config
    from rlhfkit.models import apply_lora, enable_gradient_checkpointing, load_model, train_attention

    model = load_model(cfg.model_name_or_path, kind, dtype=cfg.dtype, dropout=cfg.dropout,
                       attn_implementation=train_attention(cfg.attn_implementation, row_len or cfg.max_seq_len, dist.on_cuda(), cfg.dtype),
                       zero3_ds_config=init_config(zero_stage=cfg.zero_stage, dtype=cfg.dtype, offload=cfg.offload),
                       trust_remote_code=cfg.trust_remote_code, allow_pickle=cfg.allow_pickle_weights, pad_token_id=pad_token_id)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    model = apply_lora(model, cfg.lora_dim, cfg.lora_alpha, cfg.lora_module_name, cfg.only_optimize_lora,
                       task_type="SEQ_CLS" if kind == "reward" else "CAUSAL_LM")
    return build_engine(model, plan=plan, zero_stage=cfg.zero_stage, dtype=cfg.dtype, offload=cfg.offload,
                        learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay, betas=(cfg.adam_beta1, cfg.adam_beta2),
                        gradient_clipping=cfg.gradient_clipping, lr_scheduler_type=cfg.lr_scheduler_type,
                        num_warmup_steps=cfg.num_warmup_steps, total_steps=total_steps, lora_learning_rate=cfg.lora_learning_rate,
                        block_leaves=cfg.zero3_block_leaves)
