"""What every training program does around its own work: start (config, quiet libraries, process
group, host memory, seed), read its data split, keep a resumable run state, print the end-of-run
summary, and exit with one clear line on a user error or a dead peer rank."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional

import torch

from rlhfkit import distributed as dist
from rlhfkit.errors import RlhfkitError


def run_main(main: Callable[[], Any]) -> None:
    """Run a program's ``main``: user errors print one message (no traceback) and exit with status 2."""
    from rlhfkit.preempt import PREEMPTED_EXIT, Preempted

    try:
        main()
        _report_memory()
    except Preempted as e:
        print(str(e), file=sys.stderr, flush=True)
        sys.exit(PREEMPTED_EXIT)
    except RlhfkitError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
    except Exception as e:  # a peer rank died or hung: say so in one line instead of a gloo/NCCL stack
        if dist.world_size() > 1 and _is_collective_failure(e):
            dist.end_after_failed_collective(type(e).__name__, str(e).splitlines()[0][:200])
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


def start_program(config_cls: type) -> Any:
    """Parse the program's config, quiet the libraries, join the process group (keeping freed host
    memory on the CPU: :func:`join_process_group`), seed everything, catch the preemption signals."""
    from rlhfkit.config import parse_config

    from rlhfkit import preempt

    if os.environ.get("RLHFKIT_REPORT_MEMORY") == "1":  # the baseline: every library the run imports, nothing else
        import deepspeed  # noqa: F401
        import transformers  # noqa: F401

        _RSS_AT_START["gb"] = rss_gb() if not torch.cuda.is_available() else 0.0
    cfg = parse_config(config_cls)
    silence_libraries()
    join_process_group(cfg.dist_timeout_s)
    dist.set_seed(cfg.seed)
    preempt.install(getattr(cfg, "preempt_signals", "none"))  # every program's config has both (LogArgs)
    if hasattr(cfg, "resume"):
        cfg.resume = preempt.requeued_resume(cfg.resume)
    return cfg


def join_process_group(timeout_s: int) -> torch.device:
    """:func:`rlhfkit.distributed.init`, then, when the tensors live in host memory (not CUDA), keep
    what each step frees for the next (:mod:`rlhfkit.host_memory`, :mod:`rlhfkit.zero3_grad_buffer`) -> this
    rank's device."""
    from rlhfkit import zero3_grad_buffer
    from rlhfkit.host_memory import keep_freed_memory

    device = dist.init(timeout_s)
    if device.type != "cuda":  # each step frees and re-allocates the same large host tensors
        keep_freed_memory()
        zero3_grad_buffer.install()
    return device


def load_split(cfg: Any, *, phase: int, need: str, tokenize: Callable, tokenizer: Any,
               tokenize_eval: Optional[Callable] = None) -> tuple[list, list, list]:
    """This program's share of every data source, tokenised (the held-out rows by ``tokenize_eval`` when
    given): (train features, eval features, source reports), with what was read, skipped and truncated
    printed on rank 0."""
    from rlhfkit.data import load_phase_data

    train_rows, eval_rows, sources = load_phase_data(cfg.data_path, phase=phase, need=need, data_split=cfg.data_split,
                                                     seed=cfg.seed, eval_fraction=cfg.eval_fraction, strict=cfg.strict,
                                                     max_eval=cfg.max_eval_samples, max_per_prompt=cfg.max_per_prompt)
    train_set, train_report = tokenize(train_rows, tokenizer, cfg.max_seq_len)
    eval_set, eval_report = (tokenize_eval or tokenize)(eval_rows, tokenizer, cfg.max_seq_len)
    for s in sources:
        dist.print_rank0(s.summary())
    dist.print_rank0(f"train: {train_report.summary()}\neval: {eval_report.summary()}")
    return train_set, eval_set, sources


def make_run_state(cfg: Any, engines: dict[str, Any], logger: Any = None):
    """The :class:`rlhfkit.resume.RunState` of a program from its config's resume flags; ``logger``'s tracker
    run ids go into its states, and a restored state's go back to the logger."""
    from rlhfkit.config import config_dict
    from rlhfkit.resume import RunState

    state = RunState(cfg.output_dir, engines, config_dict(cfg), save_interval=cfg.save_interval, keep_last_k=cfg.keep_last_k,
                     resume=cfg.resume, allow_config_change=cfg.resume_allow_config_change)
    state.logger = logger
    return state


def make_logger(cfg: Any, program: str):
    """The program's :class:`rlhfkit.metrics.MetricsLogger`: <output_dir>/logs, --report_to, the config as the
    trackers' parameters."""
    from rlhfkit.config import config_dict
    from rlhfkit.metrics import MetricsLogger

    return MetricsLogger(os.path.join(cfg.output_dir, "logs"), cfg.enable_tensorboard, cfg.tensorboard_path, program,
                         cfg.report_to, config_dict(cfg))


def rss_gb() -> float:
    """Resident memory of this process now, in GiB (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:
        return 0.0


_RSS_AT_START = {"gb": None}  # the resident memory once the program's imports are done (start_program)


def _report_memory() -> None:
    """With RLHFKIT_REPORT_MEMORY=1, every rank prints its peak memory and what its imports took, the figures
    ``rlhfkit plan`` is checked against (bench/plan_check.py)."""
    if os.environ.get("RLHFKIT_REPORT_MEMORY") != "1" or _RSS_AT_START["gb"] is None:
        return
    print(f"[memory] rank {dist.rank()}: peak {peak_rss_gb():.3f} GiB, after imports {_RSS_AT_START['gb']:.3f} GiB",
          flush=True)


def peak_rss_gb() -> float:
    """Peak resident memory of this process in GiB (CPU), or peak allocated CUDA memory on GPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def print_summary(title: str, lines: dict[str, Any]) -> None:
    """The end-of-run summary, rank 0 only."""
    if not dist.is_main():
        return
    width = max(len(k) for k in lines) if lines else 0
    print(f"\n==== {title} ====", flush=True)
    for k, v in lines.items():
        print(f"  {k.ljust(width)}  {v}", flush=True)
