"""Run the programs of another git revision beside the current code: the `--against REV` harness.

A revision is checked out once as a detached git worktree under ``<repo>/.cache/against/<short-sha>``
(``.cache/`` is gitignored) and reused by later runs. Both trees run in the same virtual environment:

- each program puts its own checkout root first on ``sys.path`` (the top of ``stepN/main.py``), so
  ``<tree>/step3_ppo/main.py`` imports ``<tree>/rlhfkit``;
- every command here also sets ``PYTHONPATH=<tree root>``. The venv installs rlhfkit in editable mode
  through a meta-path finder (``__editable___rlhfkit_*_finder.py``) that ``sys.meta_path`` consults
  after the ``sys.path`` entries, so ``PYTHONPATH`` wins over it: with ``PYTHONPATH=/tmp/x`` holding
  a package ``rlhfkit``, ``import rlhfkit`` loads ``/tmp/x/rlhfkit`` (checked by hand), and
  :func:`check_imports` checks it again for each tree before use.

Speed comparisons alternate the two sides round by round (the side that goes first swaps every round,
so a drift of the machine's speed falls on both) and report medians, spreads and ratios
(:func:`summarize`, :func:`print_against`). Figures only: nothing here asserts a timing.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
AGAINST = REPO / ".cache" / "against"
PROGRAMS = ("step1_sft/main.py", "step2_reward/main.py", "step2_dpo/main.py", "step3_ppo/main.py", "step2_reward/evaluate.py")


@dataclass(frozen=True)
class Tree:
    """A checkout whose programs can be run: ``name`` labels it in tables ("current" or a short sha)."""
    name: str
    root: Path


def git(*args: str, cwd: Path = REPO) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def current_tree(root: str | os.PathLike | None = None) -> Tree:
    """The working tree this bench lives in (or ``root``, another checkout), as it is now."""
    tree = Tree("current", Path(root).resolve() if root else REPO)
    check_imports(tree)
    return tree


def revision_tree(rev: str) -> Tree:
    """``rev``'s code in a detached worktree under .cache/against/<short-sha>, created on first use."""
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    short = git("rev-parse", "--short", sha)
    path = AGAINST / short
    if path.exists():
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True).stdout.strip()
        if head != sha:
            raise SystemExit(f"{path} exists but is not a worktree at {sha} (HEAD {head or 'unknown'}); "
                             f"remove it with `git worktree remove --force {path}` and run again")
        dirty = git("status", "--porcelain", "--untracked-files=no", cwd=path)
        if dirty:
            raise SystemExit(f"worktree {path} has local changes:\n{dirty}")
    else:
        AGAINST.mkdir(parents=True, exist_ok=True)
        git("worktree", "add", "--detach", str(path), sha)
    tree = Tree(short, path)
    check_imports(tree)
    return tree


def tree_env(tree: Tree, threads: int | None = None, extra: dict | None = None) -> dict:
    """The environment for a program of ``tree``: its root first on PYTHONPATH, offline hub, unbuffered output."""
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(tree.root), env.get("PYTHONPATH", "")) if p),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.update(extra or {})
    return env


def check_imports(tree: Tree) -> None:
    """Fail unless ``import rlhfkit`` resolves inside ``tree`` under :func:`tree_env` (not the editable install)."""
    code = "import rlhfkit; print(rlhfkit.__file__)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tempfile.gettempdir(), env=tree_env(tree),
                          capture_output=True, text=True)
    where = Path(proc.stdout.strip() or "/nonexistent").resolve()
    if proc.returncode != 0 or tree.root.resolve() not in where.parents:
        raise SystemExit(f"rlhfkit does not import from {tree.root} with PYTHONPATH set (got {where}):\n{proc.stderr[-2000:]}")


def program_cmd(tree: Tree, script: str, args: list[str], nprocs: int, port: int | None = None) -> list[str]:
    """``tree``'s program ``script`` (relative to the root) under the deepspeed launcher with ``nprocs``
    ranks, or as a plain Python process when ``nprocs == 0``."""
    program = str(tree.root / script)
    if nprocs == 0:
        return [sys.executable, program, *args]
    return [str(VENV_BIN / "deepspeed"), "--num_gpus", str(nprocs), "--master_port", str(port or free_port()), program, *args]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_program(tree: Tree, script: str, args: list[str], nprocs: int, env: dict | None = None,
                timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run a program of ``tree`` to completion; exit with its output tail if it fails."""
    port = free_port()
    cmd = program_cmd(tree, script, args, nprocs, port)
    try:
        proc = subprocess.run(cmd, cwd=tree.root, env=env or tree_env(tree), capture_output=True, text=True, timeout=timeout)
    finally:  # a killed rank leaves DeepSpeed's shared-memory all-reduce buffers behind
        for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
            os.unlink(path)
    if proc.returncode != 0:
        raise SystemExit(f"[{tree.name}] {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


# Run inside a tree: run each program given until its first argument parse, and write that parser's options
# and help text instead (the parse raises, so nothing else of the program runs; the next program reuses the imports).
_DUMP_OPTIONS = r"""
import argparse, json, os, runpy, sys

class Parsed(BaseException):  # not an Exception: the programs' error handlers let it through
    pass

def dump(self, args=None, namespace=None):
    options = {}
    for a in self._actions:
        if a.dest == "help":
            continue
        kind = getattr(a.type, "__name__", repr(a.type)) if a.type is not None else None
        key = a.dest if a.dest not in options else a.dest + "#" + min(a.option_strings, key=len)  # e.g. --no_progress_bar
        options[key] = {"flags": sorted(a.option_strings), "default": a.default, "type": kind, "nargs": a.nargs,
                        "choices": list(a.choices) if a.choices else None, "required": a.required}
    raise Parsed({"options": options, "help": self.format_help()})

argparse.ArgumentParser.parse_known_args = dump
found = {}
for script in sys.argv[1:]:
    sys.argv = [script]
    try:
        runpy.run_path(script, run_name="__main__")
    except Parsed as p:
        found[os.path.relpath(script, os.getcwd())] = p.args[0]
    else:
        sys.exit(f"{script} returned without parsing its arguments")
with open(os.environ["RLHFKIT_DUMP_OPTIONS"], "w") as f:
    json.dump(found, f, default=repr, sort_keys=True)
"""


def programs_options(tree: Tree, scripts: tuple[str, ...] | list[str]) -> dict[str, dict]:
    """Each program's command line in ``tree``: script -> {"options": dest -> {flags, default, type, nargs,
    choices, required}, "help": the text --help prints} (a second option of a dest, such as HfArgumentParser's
    --no_<flag>, under "dest#--no_<flag>"), read from the parser the program builds (its
    parse is intercepted; nothing else runs). One process per tree."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "options.json")
        proc = subprocess.run([sys.executable, "-c", _DUMP_OPTIONS, *(str(tree.root / s) for s in scripts)], cwd=tree.root,
                              env=tree_env(tree, extra={"RLHFKIT_DUMP_OPTIONS": out}), capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            raise SystemExit(f"[{tree.name}] reading the options of {', '.join(scripts)} failed:\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def program_options(tree: Tree, script: str) -> dict[str, dict]:
    """``script``'s options in ``tree`` (see :func:`programs_options`)."""
    return programs_options(tree, [script])[script]["options"]


def flag_value(value) -> list[str]:
    """A pinned value as command-line words (booleans as true/false, lists as several words)."""
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return [str(value)]


def pinned_args(flags: dict, *option_sets: dict[str, dict]) -> tuple[list[str], list[str]]:
    """``flags`` (dest -> value) as arguments, keeping only the dests every tree's options know.
    Returns (argv, dropped dests); a dropped flag is passed to neither side."""
    known = set.intersection(*(set(o) for o in option_sets)) if option_sets else set(flags)
    argv: list[str] = []
    dropped = []
    for dest, value in flags.items():
        if dest not in known:
            dropped.append(dest)
            continue
        argv += [f"--{dest}", *flag_value(value)]
    return argv, dropped


def pin_report(flags: dict, unset: dict, options: dict[str, dict[str, dict]]) -> list[str]:
    """Lines naming what the pinning misses: options of a tree neither pinned nor knowingly left unset
    (their defaults apply), defaults of such options that differ between the trees, flags dropped."""
    lines = []
    names = list(options)
    for name, opts in options.items():
        loose = sorted(d for d in set(opts) - set(flags) - set(unset) - {"config"} if "#" not in d)
        if loose:
            lines.append(f"[{name}] options not pinned (their defaults apply): {', '.join(loose)}")
        missing = sorted(set(flags) - set(opts))
        if missing:
            lines.append(f"[{name}] pinned flags this tree lacks (passed to no side): {', '.join(missing)}")
    if len(names) == 2:
        a, b = (options[n] for n in names)
        for dest in sorted((set(a) & set(b)) - set(flags)):
            if a[dest]["default"] != b[dest]["default"]:
                lines.append(f"unpinned --{dest}: default {a[dest]['default']!r} ({names[0]}) vs {b[dest]['default']!r} ({names[1]})")
    return lines


def side_order(sides: list, round_index: int) -> list:
    """The sides of one round: in order on even rounds, reversed on odd ones."""
    return list(sides) if round_index % 2 == 0 else list(reversed(sides))


def spread(values: list[float]) -> dict:
    """Median, min, max and interquartile range of one side's per-round figures."""
    vals = sorted(values)
    q1, q3 = (statistics.quantiles(vals, n=4, method="inclusive")[i] for i in (0, 2)) if len(vals) > 1 else (vals[0], vals[0])
    return {"median": statistics.median(vals), "min": vals[0], "max": vals[-1], "q1": q1, "q3": q3, "n": len(vals),
            "values": values}


def summarize(runs: list[dict], metrics: tuple[str, ...], rev: str, current: str = "current") -> dict:
    """Per configuration: each side's spread of every metric over rounds, and current/rev of the medians.
    ``runs``: dicts with "round", "config", "side" and the metrics."""
    out: dict = {}
    for config in dict.fromkeys(r["config"] for r in runs):
        sides = {}
        for side in (rev, current):
            mine = [r for r in runs if r["config"] == config and r["side"] == side]
            sides[side] = {m: spread([r[m] for r in mine]) for m in metrics if mine and all(m in r for r in mine)}
        ratio = {m: sides[current][m]["median"] / sides[rev][m]["median"]
                 for m in metrics if m in sides[current] and m in sides[rev] and sides[rev][m]["median"]}
        out[config] = {"sides": sides, "ratio_current_over_rev": ratio,
                       "round_ratios": round_ratios(runs, config, metrics, rev, current)}
    return out


def round_ratios(runs: list[dict], config: str, metrics: tuple[str, ...], rev: str, current: str) -> dict:
    """Each metric's current/rev ratio within every round (the two runs of a round ran minutes apart, so a
    slow drift of the machine cancels), and their median and spread."""
    out = {}
    for m in metrics:
        values = []
        for rnd in sorted({r["round"] for r in runs}):
            pair = {r["side"]: r for r in runs if r["round"] == rnd and r["config"] == config}
            if rev in pair and current in pair and pair[rev].get(m) and m in pair[current]:
                values.append(pair[current][m] / pair[rev][m])
        if values:
            out[m] = spread(values)
    return out


def print_against(runs: list[dict], summary: dict, metrics: tuple[str, ...], rev: str, current: str = "current") -> None:
    """Print the per-round figures, then each side's median [min-max] and the ratio current/rev."""
    width = 15
    print(f"\nper round (seconds; ratio = current / {rev}; the side that runs first alternates):")
    print(f"{'round':<7}{'config':<22}{'side':<10}" + "".join(f"{m:>{width}}" for m in metrics))
    for rnd in sorted({r["round"] for r in runs}):
        for config in summary:
            pair = {r["side"]: r for r in runs if r["round"] == rnd and r["config"] == config}
            for side in (rev, current):
                if side in pair:
                    cells = "".join(f"{pair[side].get(m, float('nan')):>{width}.3f}" for m in metrics)
                    print(f"{rnd + 1:<7}{config:<22}{side:<10}{cells}")
            if rev in pair and current in pair:
                ratios = "".join(f"{pair[current][m] / pair[rev][m]:>{width}.3f}" if pair[rev].get(m) else f"{'-':>{width}}"
                                 for m in metrics)
                print(f"{rnd + 1:<7}{config:<22}{'ratio':<10}{ratios}")
    print(f"\noverall: median [min-max] over rounds; IQR in the JSON; ratio = current / {rev} of the medians")
    print(f"{'config':<22}{'side':<10}" + "".join(f"{m:>{width + 8}}" for m in metrics))
    for config, s in summary.items():
        for side in (rev, current):
            cells = "".join(f"{_cell(s['sides'][side].get(m)):>{width + 8}}" for m in metrics)
            print(f"{config:<22}{side:<10}{cells}")
        ratio = s["ratio_current_over_rev"]
        print(f"{config:<22}{'ratio':<10}" + "".join(f"{ratio[m]:>{width + 8}.3f}" if m in ratio else f"{'-':>{width + 8}}"
                                                    for m in metrics))
        print(f"{config:<22}{'rnd ratio':<10}" + "".join(f"{_cell(s['round_ratios'].get(m)):>{width + 8}}" for m in metrics))
    print("(ratio: of the medians; rnd ratio: median [min-max] of the rounds' own ratios)")


def _cell(s: dict | None) -> str:
    return "-" if not s else f"{s['median']:.3f} [{s['min']:.2f}-{s['max']:.2f}]"
