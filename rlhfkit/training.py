"""Former home of the programs' shared training machinery, now split by concern; kept so that code
importing from here still works. New code imports from the modules themselves:

- :mod:`rlhfkit.program`: start, entry wrapper, data split, run state, end-of-run summary;
- :mod:`rlhfkit.engines`: DeepSpeed engines (trained and frozen) and step counts;
- :mod:`rlhfkit.loaders`: sharded loaders, the length-grouped sampler, batch streams;
- :mod:`rlhfkit.supervised`: the supervised loop of steps 1, 2 and DPO;
- :mod:`rlhfkit.params`: weight EMA and checksum on each rank's partition;
- :mod:`rlhfkit.faults`: fault injection for tests.
"""

from __future__ import annotations

from rlhfkit.engines import (
    batch_plan, build_engine, build_frozen_engine, count_steps, trainable_engine, zero3_block_leaves,
)
from rlhfkit.faults import _CRASH_COUNTS, crash_point, nonfinite_injected  # noqa: F401
from rlhfkit.loaders import (
    BatchStream, LengthGroupedSampler, ListDataset, eval_batches, feature_length, to_device, train_loader,
)
from rlhfkit.params import ParamEMA, param_fingerprint
from rlhfkit.program import (  # noqa: F401
    _is_collective_failure, load_split, make_run_state, peak_rss_gb, print_summary, run_main, silence_libraries,
    start_program,
)
from rlhfkit.supervised import LoopResult, NonFiniteGuard, fit

__all__ = [
    "BatchStream", "LengthGroupedSampler", "ListDataset", "LoopResult", "NonFiniteGuard", "ParamEMA", "batch_plan",
    "build_engine", "build_frozen_engine", "count_steps", "crash_point", "eval_batches", "feature_length", "fit",
    "load_split", "make_run_state", "nonfinite_injected", "param_fingerprint", "peak_rss_gb", "print_summary", "run_main",
    "silence_libraries", "start_program", "to_device", "train_loader", "trainable_engine", "zero3_block_leaves",
]
