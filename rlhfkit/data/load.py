"""``load_phase_data``: the rows one training step uses, from one or several sources, with reports.

For each source separately:
  1. read every row in file order (sources.py) and detect its format (formats.py);
  2. take this phase's share of a seeded permutation of the rows, grouped by prompt (splits.py);
  3. convert the share's rows, skipping (and counting) those unusable for ``need``,
     or raising on the first one under ``strict``;
  4. keep at most ``max_per_prompt`` usable rows of each prompt (a seeded draw), when given;
  5. cut the usable rows into train and eval.
The sources' train lists are concatenated (blended), and so are their eval lists. A row whose prompt an
earlier source already holds (MGSM's English problems are GSM8K's first 250) is dropped from the later
source before its split, and counted: no prompt is trained on from one file and held out from another.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

from rlhfkit.data.formats import NEEDS, Example, Skip, convert_row, detect_format
from rlhfkit.data.sources import read_source, split_paths
from rlhfkit.data.splits import STEP_NAMES, cap_per_group, cut_eval, group_ids, parse_data_split, phase_rows
from rlhfkit.errors import ConfigError, DataError

FIRST_SKIPS = 5  # how many (row, reason) examples a report keeps
_ORDER = {"prompts": 0, "sft": 1, "labelled": 1.5, "pairs": 2}  # a source serves the needs at or below its own
_NEED_WORDS = {
    "sft": "prompts with responses",
    "labelled": "prompts with completions labelled desirable or undesirable (or pairs)",
    "pairs": "prompts with chosen and rejected responses",
    "prompts": "prompts",
}


@dataclass
class SourceReport:
    """What was read from one source for one phase; printed by the programs, kept in the manifest."""

    path: str  # as given in --data_path
    format: str  # "hh-rlhf (jsonl.gz)": row format (container)
    sha256: str  # of the file's bytes (directory / hub: of its parts)
    rows: int  # rows in the whole source
    kept: int  # usable rows in this phase's share, after --max_per_prompt (= train_rows + eval_rows)
    skipped: dict[str, int]  # reason -> count, among this phase's share
    first_skips: list[tuple[int, str]]  # the first few (row, reason), by row number
    phase: int = 0
    need: str = ""
    share_rows: int = 0  # rows in this phase's share (= kept + skipped + over_cap)
    train_rows: int = 0
    eval_rows: int = 0
    duplicates: int = 0  # rows whose prompt an earlier source holds, dropped before the split
    over_cap: int = 0  # usable rows dropped by --max_per_prompt
    max_per_prompt: int | None = None

    def summary(self) -> str:
        line = (
            f"{self.path} [{self.format}, sha256 {self.sha256[:12]}]: {self.rows} rows; "
            f"phase {self.phase} share {self.share_rows}, kept {self.kept} for {self.need} "
            f"(train {self.train_rows}, eval {self.eval_rows})"
        )
        if self.duplicates:
            line += f"; {self.duplicates} rows dropped before the split: their prompts are in an earlier --data_path"
        if self.over_cap:
            rows = "row" if self.over_cap == 1 else "rows"
            line += f"; {self.over_cap} {rows} dropped by --max_per_prompt {self.max_per_prompt} (at most that many per prompt)"
        if not self.skipped:
            return line + ", none skipped"
        return f"{line}\n  {self.skips_text()}"

    def skips_text(self) -> str:
        """``skipped 3: empty response 2, chosen == rejected 1; first rows: 4 (empty response), ...``"""
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(self.skipped.items(), key=lambda x: -x[1]))
        first = ", ".join(f"{row} ({r})" for row, r in self.first_skips)
        return f"skipped {sum(self.skipped.values())}: {reasons}; first rows: {first}"


@dataclass(frozen=True)
class Reader:
    """Who reads the data, as its error messages name it: the step, and the flag that gives it files."""

    step: str
    flag: str = "--data_path"


def load_phase_data(
    paths: str | list[str],
    phase: int,
    need: str,
    data_split: str = "2,4,4",
    seed: int = 1234,
    eval_fraction: float = 0.1,
    strict: bool = False,
    max_eval: int | None = None,
    max_per_prompt: int | None = None,
    reader: Reader | None = None,
) -> tuple[list[Example], list[Example], list[SourceReport]]:
    """(train, eval, reports) for one step.

    phase: 1, 2 or 3, which of the ``data_split`` shares ("2,4,4": 20%/40%/40%) this step takes.
    need: "sft" (prompt + chosen), "pairs" (chosen and rejected, different), "labelled" (a desirable and/or an
    undesirable completion: KTO) or "prompts".
    eval_fraction: part of each source's usable share held out for eval (>= 1 row when there
        are >= 2); max_eval caps the eval rows taken from each source (the rest stay in train).
    strict: raise DataError on the first unusable row instead of skipping and counting it.
    max_per_prompt: keep at most this many usable rows of each prompt (a seeded draw), held-out and
        training alike. Preference sets with several pairs per instruction (AlpacaEval's) give one
        instruction's pairs as much weight as its number of pairs, and their held-out pairs are not
        independent; 1 keeps one pair per instruction.
    reader: how the errors name the reader (default: the phase's step and --data_path).
    """
    if phase not in (1, 2, 3):
        raise ConfigError(f"phase must be 1, 2 or 3, not {phase!r}")
    if need not in NEEDS:
        raise ConfigError(f"need must be one of {', '.join(NEEDS)}, not {need!r}")
    if not 0 <= eval_fraction < 1:
        raise ConfigError(f"eval_fraction must be in [0, 1), not {eval_fraction!r}")
    if max_per_prompt is not None and max_per_prompt < 1:
        raise ConfigError(f"--max_per_prompt must be at least 1 (or left unset: every row), not {max_per_prompt}")
    reader = reader or Reader(STEP_NAMES[phase])
    fractions = parse_data_split(data_split)
    if fractions[phase - 1] == 0:
        raise DataError(
            f"--data_split {data_split} gives {reader.step} no share of the data (its share is 0). "
            f"Give it a share, e.g. --data_split 2,4,4 to split one dataset across the three steps, or "
            f"{_only_phase(phase)} to give this step all rows of its own dataset."
        )
    sources = split_paths(paths)
    if not sources:
        raise DataError(f"no data given: pass one or more files with {reader.flag}.")

    train: list[Example] = []
    evals: list[Example] = []
    reports: list[SourceReport] = []
    seen: set[str] = set()  # prompt keys of the sources read so far
    for path in sources:
        t, e, report = _load_source(path, phase, need, data_split, fractions, seed,
                                    eval_fraction, strict, max_eval, seen, max_per_prompt, reader)
        train += t
        evals += e
        reports.append(report)
    return train, evals, reports


def load_ptx_rows(paths: str | list[str], seed: int, strict: bool) -> list[Example]:
    """Every usable row (prompt and response) of step 3's PTX data, ``--unsupervised_dataset_name``, read as
    step 1 reads its data; the errors name the PTX loss and its flag."""
    rows, _, _ = load_phase_data(paths, phase=1, need="sft", data_split="1,0,0", seed=seed, eval_fraction=0.0,
                                 strict=strict, reader=Reader("the PTX loss (step 3's --unsupervised_dataset_name)",
                                                              "--unsupervised_dataset_name"))
    return rows


def _only_phase(phase: int) -> str:
    return "--data_split " + ",".join("10" if p == phase else "0" for p in (1, 2, 3))


def prompt_key(fmt, raw, row: int):
    """The prompt of a raw row as a string (the key that keeps rows of one prompt together), or the row
    number for a row without a readable prompt (its own group)."""
    value = raw.rows[row]
    try:
        return json.dumps(fmt.convert(value, "prompts")[0], sort_keys=True)
    except Exception:  # noqa: BLE001 - any unreadable row is skipped later, with its reason
        return row


def _load_source(path, phase, need, data_split, fractions, seed, eval_fraction, strict, max_eval, seen,
                 max_per_prompt, reader):
    raw = read_source(path)
    fmt = detect_format(raw)
    if _ORDER[fmt.provides] < _ORDER[need]:
        raise DataError(
            f"{path} holds {_NEED_WORDS[fmt.provides]} (format {fmt.name}), but "
            f"{reader.step} needs {_NEED_WORDS[need]}. Use this file for a step that needs "
            f"{_NEED_WORDS[fmt.provides]}, or pass another {reader.flag}."
        )
    keys = [prompt_key(fmt, raw, row) for row in range(len(raw.rows))]
    rows = [row for row, key in enumerate(keys) if key not in seen]  # without prompts of earlier sources
    seen.update(k for k in keys if isinstance(k, str))
    if raw.rows and not rows:
        raise DataError(f"{path}: every prompt of its {len(raw.rows)} rows is already in an earlier {reader.flag}. "
                        f"Drop the duplicate file from {reader.flag}.")
    local_groups = group_ids([keys[row] for row in rows])
    share = [rows[i] for i in phase_rows(len(rows), fractions, phase, seed, local_groups)]
    groups = dict(zip(rows, local_groups))
    if not share:
        raise DataError(
            f"--data_split {data_split} leaves {reader.step} no rows of {path}: its share "
            f"({fractions[phase - 1]:.0%}) of {len(raw.rows)} rows rounds to 0. Use more data, or give "
            f"this step a larger share, e.g. {_only_phase(phase)}."
        )

    usable: dict[int, Example] = {}
    skipped: Counter[str] = Counter()
    first_skips: list[tuple[int, str]] = []
    for row in sorted(share):  # file order, so that "the first" skipped rows are the first
        try:
            usable[row] = convert_row(fmt, raw, row, need)
        except Skip as s:
            if strict:
                detail = f" ({s.detail})" if s.detail else ""
                raise DataError(
                    f"{path}: row {row} ({raw.where(row)}): {s.reason}{detail}. Fix or remove the "
                    "row, or run without --strict to skip such rows (they are counted and reported)."
                ) from None
            skipped[s.reason] += 1
            if len(first_skips) < FIRST_SKIPS:
                first_skips.append((row, s.reason))

    ordered = [i for i in share if i in usable]  # the share's permuted order
    kept = ordered if max_per_prompt is None else cap_per_group(ordered, [groups[i] for i in ordered], max_per_prompt, seed)
    report = SourceReport(
        path=path, format=f"{fmt.name} ({raw.container})", sha256=raw.sha256, rows=len(raw.rows),
        kept=len(kept), skipped=dict(skipped), first_skips=first_skips, phase=phase, need=need,
        share_rows=len(share), duplicates=len(raw.rows) - len(rows), over_cap=len(ordered) - len(kept),
        max_per_prompt=max_per_prompt,
    )
    if not usable:
        raise DataError(
            f"{path} has no usable rows for {reader.step} (need {need}): all "
            f"{len(share)} rows of its share were {report.skips_text()}. Check the file against "
            f"its format ({report.format}), or run with --strict to stop at the first bad row."
        )
    train, evals = cut_eval([usable[i] for i in kept], eval_fraction, max_eval, [groups[i] for i in kept])
    report.train_rows, report.eval_rows = len(train), len(evals)
    return train, evals, report
