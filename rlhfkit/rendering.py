"""What the two reports (``rlhfkit report`` and ``rlhfkit eval``) render the same way: numbers, markdown
table cells and code fences, and one matplotlib figure written to a PNG."""

from __future__ import annotations

import contextlib
import math
import re
from pathlib import Path
from typing import Iterator, Optional


def fmt(v: Optional[float]) -> str:
    """A number for a table: 4 significant digits, scientific when tiny or huge, "–" for none."""
    if v is None:
        return "–"
    if not math.isfinite(v):
        return str(v)
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
        return f"{v:.3e}"
    return f"{v:.4g}"


def md_escape(s: str) -> str:
    """Text for a markdown table cell: a ``|`` would end the cell."""
    return s.replace("|", "\\|")


def fence(text: str, max_chars: int) -> str:
    """``text`` (cut after ``max_chars``) as a fenced code block whose fence is longer than any
    backtick run inside it, so model output cannot close it early."""
    longest = max((len(run) for line in text.split("\n") for run in re.findall(r"`+", line)), default=0)
    ticks = "`" * max(3, longest + 1)
    shown = text if len(text) <= max_chars else text[:max_chars] + " [...]"
    return f"{ticks}text\n{shown}\n{ticks}"


@contextlib.contextmanager
def png_figure(path: Path, figsize: tuple[float, float] = (7, 4), dpi: int = 110) -> Iterator:
    """One figure's axes; saved to ``path`` (tight layout) when the block ends without an error,
    closed in any case (pyplot keeps every open figure alive). No display needed (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize, dpi=dpi)
    try:
        yield ax
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def label_axes(ax, title: str, xlabel: str, ylabel: str, legend: bool = True) -> None:
    """Title, axis labels, a light grid and (``legend``) the legend of the labelled artists."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if legend:
        ax.legend(loc="best", fontsize=8)
