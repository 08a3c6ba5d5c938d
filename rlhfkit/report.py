"""`rlhfkit report`: a run's metrics as ``report.md`` plus PNG plots.

Every ``logs/metrics.jsonl`` under the run directory (``step1/``, ``step2/``, ``dpo/``, ``step3/``
or deeper) is one *stage*. Records are JSON objects ``{"program", "step", "time_s", key: value, ...}``;
a key's series keeps the last value logged for each step (a resumed run overrides the steps it
repeats, and train and eval records of one step merge). Plots are drawn only for the series that
exist; ``report.md`` holds a headline table (per stage: steps, first -> last of its key metrics),
a per-stage table of every numeric series, and the plots. For step 3 these include the held-out
evaluation (``eval/*``: reward with its band over prompts, KL to the reference), the learning curve on
prompts the actor never trains on.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from rlhfkit.errors import RlhfkitError
from rlhfkit.outcomes import outcome_lines
from rlhfkit.rendering import fmt, label_axes, md_escape, png_figure

METRICS_FILE = "metrics.jsonl"
PROGRAM_ORDER = ("sft", "reward", "dpo", "ppo")
PROGRAM_TITLES = {"sft": "Supervised fine-tuning", "reward": "Reward model", "dpo": "DPO", "ppo": "PPO"}

# Headline metrics per program, in table order (those that exist are shown).
HEADLINE = {
    "sft": ("train/loss", "eval/loss", "eval/perplexity"),
    "reward": ("train/loss", "eval/accuracy", "eval/margin"),
    "dpo": ("train/loss", "eval/accuracy", "eval/margin"),
    "ppo": ("reward/score_mean", "kl/per_token", "gen/response_len", "eval/reward", "eval/kl_per_token"),
}
DEFAULT_HEADLINE = ("train/loss", "eval/loss", "eval/accuracy")
# Step 3 logs under its --algo name and every step-3 algorithm logs PPO's keys, so each name of the
# algorithm registry (rlhfkit.rl.ALGOS) gets PPO's table rows and plots: see program_family. Other
# names that log another program's keys: REINFORCE++ under the paper's spelling, DPO's IPO loss.
OTHER_FAMILIES = {"reinforce++": "ppo", "ipo": "dpo"}


def program_family(program: str) -> str:
    """The program whose table rows and plots a stage logged by ``program`` gets."""
    from rlhfkit.rl import ALGOS  # torch: imported only when a report is written

    if program in ALGOS:
        return "ppo"
    return OTHER_FAMILIES.get(program, program)


@dataclass(frozen=True)
class PlotSpec:
    """One PNG: ``keys`` drawn as lines on the left axis, ``right`` on a second axis; ``stack`` = stacked areas;
    ``band`` = the standard-error series of ``keys[0]``, drawn as a shaded +- 1.96 standard errors (95%) band;
    ``x`` = another series as the x axis instead of the step (points of the same step joined in step order);
    ``requires``: drawn only when one of these series exists."""

    name: str
    title: str
    keys: tuple[str, ...]
    ylabel: str = ""
    right: tuple[str, ...] = ()
    right_label: str = ""
    stack: bool = False
    band: str = ""
    x: str = ""
    requires: tuple[str, ...] = ()


JUDGES = ("eval/judge", "eval/judge1", "eval/judge2", "eval/judge3")  # step 3's --judge models, one or several
PLOTS: dict[str, tuple[PlotSpec, ...]] = {
    "sft": (
        PlotSpec("loss", "SFT loss", ("train/loss", "eval/loss"), "loss"),
        PlotSpec("perplexity", "SFT eval perplexity", ("eval/perplexity",), "perplexity"),
    ),
    "reward": (
        PlotSpec("loss", "Reward model loss", ("train/loss", "eval/loss"), "pairwise loss"),
        PlotSpec("accuracy", "Reward model accuracy (chosen > rejected)", ("train/accuracy", "eval/accuracy"), "accuracy"),
        PlotSpec("margin", "Reward model margin (r_chosen - r_rejected)", ("train/margin", "eval/margin"), "margin"),
    ),
    "dpo": (
        PlotSpec("loss", "DPO loss", ("train/loss", "eval/loss"), "loss"),
        PlotSpec("accuracy", "DPO reward accuracy", ("train/accuracy", "eval/accuracy", "rewards/accuracies"), "accuracy"),
        PlotSpec("margin", "DPO reward margin", ("train/margin", "eval/margin", "rewards/margins"), "margin"),
    ),
    "ppo": (
        PlotSpec("reward", "PPO reward score (mean)", ("reward/score_mean",), "score"),
        PlotSpec("kl", "KL to the reference", ("kl/per_token",), "KL per token", right=("kl/per_seq",), right_label="KL per sequence"),
        PlotSpec("policy_loss", "Policy loss", ("policy/loss",), "loss"),
        PlotSpec("clip_frac", "Policy clip fraction", ("policy/clip_frac",), "fraction clipped"),
        PlotSpec("value_loss", "Value loss", ("value/loss",), "loss"),
        PlotSpec("entropy", "Policy entropy", ("policy/entropy",), "nats per token"),
        PlotSpec("response_len", "Response length", ("gen/response_len",), "tokens",
                 right=("gen/truncated_rate",), right_label="truncated rate"),
        PlotSpec("time", "Time per step", ("time/generation_s", "time/experience_s", "time/training_s"), "seconds", stack=True),
        # the held-out evaluation (step 0: the step-1 model): the learning curve on prompts the actor never trains on
        PlotSpec("eval_reward", "Held-out reward (95% band over prompts)", ("eval/reward",),
                 "reward", band="eval/reward_se"),
        PlotSpec("eval_kl", "Held-out KL to the reference (k3 on the actor's samples)", ("eval/kl_per_token",), "nats per token",
                 right=("eval/kl_per_seq",), right_label="nats per sequence"),
        # the independent judges (--judge) on the same held-out responses, and the held-out rewards against the KL
        # and the response length over the run: a proxy gain that the judges do not share is over-optimisation
        PlotSpec("eval_judge", "Held-out reward under the training reward model and the judges", ("eval/reward",),
                 "training reward model", right=JUDGES, right_label="judge", requires=JUDGES),
        PlotSpec("eval_vs_kl", "Held-out rewards against the KL to the reference", ("eval/reward",),
                 "training reward model", right=JUDGES, right_label="judge", x="eval/kl_per_token", requires=JUDGES),
        PlotSpec("eval_vs_length", "Held-out rewards against the response length", ("eval/reward",),
                 "training reward model", right=JUDGES, right_label="judge", x="eval/response_len", requires=JUDGES),
        # the gsm8k rule's parts: training samples each step, held-out prompts at each evaluation
        PlotSpec("gsm8k", "GSM8K rule: accuracy and answer format", ("reward/gsm8k_accuracy", "reward/gsm8k_format",
                                                                     "eval/gsm8k_accuracy", "eval/gsm8k_format"), "rate"),
    ),
}


# ----------------------------------------------------------------------------------------------
# reading


@dataclass
class Stage:
    """One program's metrics file: ``series[key] = [(step, value), ...]`` sorted by step."""

    label: str  # path of the program's output directory relative to the run dir ("." for the run dir itself)
    path: Path
    program: str
    records: int = 0
    bad_lines: list[int] = field(default_factory=list)
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    wall_s: Optional[float] = None

    @property
    def family(self) -> str:
        return program_family(self.program)

    @property
    def slug(self) -> str:
        return self.program if self.label == "." else self.label.replace("/", "_").replace(" ", "_")

    @property
    def last_step(self) -> Optional[int]:
        steps = [s for pts in self.series.values() for s, _ in pts]
        return max(steps) if steps else None


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def find_metrics_files(run_dir: Path) -> list[Path]:
    """Every ``logs/metrics.jsonl`` under ``run_dir`` (hidden directories such as half-written exports skipped)."""
    found = []
    for root, dirs, files in os.walk(run_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if METRICS_FILE in files and Path(root).name == "logs":
            found.append(Path(root) / METRICS_FILE)
    return found


def read_stage(path: Path, run_dir: Path) -> Stage:
    out_dir = path.parent.parent
    label = out_dir.relative_to(run_dir).as_posix() if out_dir != run_dir else "."
    points: dict[str, dict[int, float]] = {}
    programs: list[str] = []
    stage = Stage(label, path, program="")
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                step = int(rec["step"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                stage.bad_lines.append(n)  # e.g. a line cut short by a crash
                continue
            if not isinstance(rec, dict):
                stage.bad_lines.append(n)
                continue
            stage.records += 1
            if rec.get("program"):
                programs.append(str(rec["program"]))
            if _is_number(rec.get("time_s")):
                stage.wall_s = max(stage.wall_s or 0.0, float(rec["time_s"]))
            for k, v in rec.items():
                if k not in ("program", "step", "time_s") and _is_number(v):
                    points.setdefault(k, {})[step] = float(v)
    stage.program = programs[-1] if programs else _guess_program(label)
    stage.series = {k: sorted(v.items()) for k, v in points.items()}
    return stage


def _guess_program(label: str) -> str:
    name = label.split("/")[-1].lower()
    return {"step1": "sft", "step2": "reward", "step3": "ppo"}.get(name, name if name in PROGRAM_ORDER else "unknown")


def load_run(run_dir: str | os.PathLike) -> list[Stage]:
    """The stages of ``run_dir`` in pipeline order; a clear error when there is nothing to report."""
    run = Path(run_dir)
    if not run.exists():
        raise RlhfkitError(f"report: run directory {run_dir} does not exist")
    if not run.is_dir():
        raise RlhfkitError(f"report: {run_dir} is not a directory")
    files = find_metrics_files(run)
    if not files:
        raise RlhfkitError(
            f"report: no logs/{METRICS_FILE} under {run_dir}; pass a run directory holding step1/, step2/ (or dpo/), "
            "step3/, or one program's --output_dir (the programs write <output_dir>/logs/metrics.jsonl)")
    stages = [read_stage(f, run) for f in files]
    empty = [s for s in stages if not s.series]
    stages = [s for s in stages if s.series]
    if not stages:
        raise RlhfkitError(
            f"report: the metrics files under {run_dir} hold no metrics ({', '.join(str(s.path) for s in empty)}); "
            "the runs have not logged a step yet")
    order = {p: i for i, p in enumerate(PROGRAM_ORDER)}
    stages.sort(key=lambda s: (order.get(s.family, len(order)), s.label))
    return stages


# ----------------------------------------------------------------------------------------------
# plotting


def _smooth(values: list[float], weight: float) -> list[float]:
    """Exponential moving average (TensorBoard style, bias-corrected), skipping non-finite values."""
    out, ema, n = [], 0.0, 0
    for v in values:
        if math.isfinite(v):
            ema, n = weight * ema + (1 - weight) * v, n + 1
        out.append(ema / (1 - weight ** n) if n else float("nan"))
    return out


def _draw_lines(ax, stage: Stage, keys: Iterable[str], colors: Iterable[str]) -> list:
    handles = []
    for key, color in zip(keys, colors):
        if key not in stage.series:
            continue
        steps, vals = zip(*stage.series[key])
        if len(vals) > 30:  # noisy RL curves: raw faint, smoothed bold
            ax.plot(steps, vals, color=color, alpha=0.25, linewidth=0.8)
            handles += ax.plot(steps, _smooth(list(vals), 0.8), color=color, linewidth=1.8, label=f"{key} (smoothed)")
        else:
            handles += ax.plot(steps, vals, color=color, linewidth=1.6, marker="o" if len(vals) <= 20 else None,
                               markersize=3, label=key)
    return handles


def plot_stage(stage: Stage, spec: PlotSpec, out_path: Path) -> bool:
    """Draw ``spec`` for ``stage`` into ``out_path``; False (nothing written) when none of its series exist."""
    if not any(k in stage.series for k in spec.keys + spec.right) or (spec.x and spec.x not in stage.series):
        return False
    if spec.requires and not any(k in stage.series for k in spec.requires):
        return False
    import matplotlib

    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    with png_figure(out_path) as ax:
        handles = None
        if spec.x:
            handles = _draw_against(ax, stage, spec.keys, spec.x, colors)
            if any(k in stage.series for k in spec.right):
                ax2 = ax.twinx()
                handles += _draw_against(ax2, stage, spec.right, spec.x, colors[len(spec.keys):])
                ax2.set_ylabel(spec.right_label)
        elif spec.stack:
            _draw_stack(ax, stage, spec, colors)
        else:
            handles = _draw_lines(ax, stage, spec.keys, colors)
            if spec.band and spec.band in stage.series and spec.keys[0] in stage.series:
                _draw_band(ax, stage, spec.keys[0], spec.band, colors[0])
            if any(k in stage.series for k in spec.right):
                ax2 = ax.twinx()
                handles += _draw_lines(ax2, stage, spec.right, colors[len(spec.keys):])
                ax2.set_ylabel(spec.right_label)
        label_axes(ax, f"{spec.title} — {stage.label if stage.label != '.' else stage.program}", spec.x or "step", spec.ylabel,
                   legend=False)
        if handles is not None:
            ax.legend(handles=handles, labels=[h.get_label() for h in handles], loc="best", fontsize=8)
    return True


def _draw_against(ax, stage: Stage, keys: Iterable[str], x: str, colors: Iterable[str]) -> list:
    """Each of ``keys`` against the series ``x`` at the steps that have both, joined in step order; the first
    and last points are labelled with their step."""
    handles, xs = [], dict(stage.series[x])
    for key, color in zip(keys, colors):
        pts = [(xs[s], v, s) for s, v in stage.series.get(key, ()) if s in xs]
        if not pts:
            continue
        px, py, steps = zip(*pts)
        handles += ax.plot(px, py, color=color, linewidth=1.4, marker="o", markersize=3, label=key)
        for i in {0, len(pts) - 1}:
            ax.annotate(f"step {steps[i]}", (px[i], py[i]), fontsize=7, color=color, textcoords="offset points", xytext=(3, 3))
    return handles


def _draw_band(ax, stage: Stage, key: str, se_key: str, color: str) -> None:
    """A shaded mean +- 1.96 standard errors around ``key``, at the steps that have both."""
    se = dict(stage.series[se_key])
    pts = [(s, v, se[s]) for s, v in stage.series[key] if s in se and math.isfinite(v) and math.isfinite(se[s])]
    if pts:
        steps, vals, errs = zip(*pts)
        ax.fill_between(steps, [v - 1.96 * e for v, e in zip(vals, errs)], [v + 1.96 * e for v, e in zip(vals, errs)],
                        color=color, alpha=0.2, linewidth=0)


def _draw_stack(ax, stage: Stage, spec: PlotSpec, colors: list[str]) -> None:
    keys = [k for k in spec.keys if k in stage.series]
    steps = sorted({s for k in keys for s, _ in stage.series[k]})
    rows = [[dict(stage.series[k]).get(s, 0.0) for s in steps] for k in keys]
    rows = [[v if math.isfinite(v) else 0.0 for v in r] for r in rows]
    labels = [k.split("/", 1)[-1] for k in keys]
    if len(steps) <= 60:
        bottom = [0.0] * len(steps)
        for row, label, color in zip(rows, labels, colors):
            ax.bar(steps, row, bottom=bottom, label=label, color=color, width=0.8)
            bottom = [b + v for b, v in zip(bottom, row)]
    else:
        ax.stackplot(steps, *rows, labels=labels, colors=colors[: len(rows)], alpha=0.85)
    ax.legend(loc="upper right", fontsize=8)


# ----------------------------------------------------------------------------------------------
# the report


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "–"
    s = int(round(seconds))
    h, m = divmod(s, 3600)
    m, s = divmod(m, 60)
    return f"{h}h {m:02d}m" if h else (f"{m}m {s:02d}s" if m else f"{s}s")


def headline(stage: Stage) -> list[tuple[str, float, float]]:
    """(key, first, last) of the stage's key metrics that exist."""
    keys = HEADLINE.get(stage.family, DEFAULT_HEADLINE)
    return [(k, stage.series[k][0][1], stage.series[k][-1][1]) for k in keys if k in stage.series]


def build_markdown(run_dir: Path, stages: list[Stage], plots: dict[str, list[tuple[str, str]]],
                   outcomes: Optional[list[str]] = None) -> str:
    lines = [f"# rlhfkit run report: `{run_dir}`", ""]
    if outcomes:
        lines += ["## Held-out outcomes", "", *[f"- {md_escape(x.strip())}" for x in outcomes], ""]
    lines += ["| Stage | Program | Steps | Records | Wall time | Key metrics (first → last) |",
              "|---|---|---:|---:|---:|---|"]
    for st in stages:
        key_metrics = "; ".join(f"{k} {fmt(a)} → {fmt(b)}" for k, a, b in headline(st)) or "–"
        lines.append(f"| {md_escape(st.label)} | {st.program} | {st.last_step} | {st.records} | {_duration(st.wall_s)} | "
                     f"{md_escape(key_metrics)} |")
    lines.append("")
    for st in stages:
        title = PROGRAM_TITLES.get(st.program, st.program.upper())
        lines += [f"## {title} — `{st.label}`", "", f"Source: `{st.path}`", ""]
        if st.bad_lines:
            shown = ", ".join(map(str, st.bad_lines[:5])) + (" ..." if len(st.bad_lines) > 5 else "")
            lines += [f"> {len(st.bad_lines)} unreadable line(s) skipped (line {shown}).", ""]
        nonfinite = [k for k, pts in st.series.items() if any(not math.isfinite(v) for _, v in pts)]
        if nonfinite:
            lines += [f"> Non-finite values (nan/inf) in: {', '.join(sorted(nonfinite))}.", ""]
        lines += ["| Metric | Points | First | Last | Min | Max |", "|---|---:|---:|---:|---:|---:|"]
        for key in sorted(st.series):
            vals = [v for _, v in st.series[key]]
            finite = [v for v in vals if math.isfinite(v)]
            lines.append(f"| {md_escape(key)} | {len(vals)} | {fmt(vals[0])} | {fmt(vals[-1])} | "
                         f"{fmt(min(finite)) if finite else '–'} | {fmt(max(finite)) if finite else '–'} |")
        lines.append("")
        for title, file in plots.get(st.label, []):
            lines += [f"![{title}]({file})", ""]
    return "\n".join(lines)


def write_report(run_dir: str | os.PathLike, out_dir: Optional[str | os.PathLike] = None, echo: bool = True) -> Path:
    """Write ``report.md`` and the plots for ``run_dir`` into ``out_dir`` (default ``run_dir/report``)."""
    run = Path(run_dir)
    stages = load_run(run)
    out = Path(out_dir) if out_dir is not None else run / "report"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RlhfkitError(f"report: cannot create --out {out} ({e.strerror or e})") from None
    plots: dict[str, list[tuple[str, str]]] = {}
    for st in stages:
        for spec in PLOTS.get(st.family, ()):
            file = f"{st.slug}_{spec.name}.png"
            if plot_stage(st, spec, out / file):
                plots.setdefault(st.label, []).append((spec.title, file))
        if st.family not in PLOTS:  # an unknown program: one plot per series
            for key in sorted(st.series):
                spec = PlotSpec(key.replace("/", "_"), key, (key,), key)
                file = f"{st.slug}_{spec.name}.png"
                plot_stage(st, spec, out / file)
                plots.setdefault(st.label, []).append((key, file))
    report = out / "report.md"
    outcomes = outcome_lines(run)
    report.write_text(build_markdown(run, stages, plots, outcomes) + "\n", encoding="utf-8")
    if echo:
        for st in stages:
            key_metrics = "; ".join(f"{k} {fmt(a)} -> {fmt(b)}" for k, a, b in headline(st))
            print(f"{st.label:<12} {st.program:<7} steps {st.last_step}: {key_metrics}")
        n = sum(len(v) for v in plots.values())
        print(f"report written to {report} ({n} plot{'s' if n != 1 else ''})")
        if outcomes:
            print("\n==== held-out outcomes ====\n" + "\n".join(outcomes))
    return report
