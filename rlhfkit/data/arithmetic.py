"""A seeded generator of simple arithmetic word problems, in GSM8K's row format.

Each problem is one or two operations (+, -, x, exact /) on small whole numbers, phrased as a short
story (level ``mixed``), or one operation on numbers up to 20 (level ``easy``); its row is ``{"question": str, "answer": "<worked steps>\\n#### <n>"}``, so every reader of
GSM8K rows takes it as is (``--data_path`` detects the format, the ``gsm8k`` reward grades it).
The same (n, seed) gives the same rows, on every machine: the generator draws from its own
``random.Random(seed)``. Questions are unique within one call.

It is a rule-rewarded task on which a small model's accuracy can really rise within a short RL run:
real GSM8K problems take a 135M model three to five steps it rarely gets right.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

NAMES = ("Ava", "Ben", "Chloe", "Dan", "Ella", "Finn", "Grace", "Hugo", "Ivy", "Jack", "Kate", "Leo",
         "Mia", "Noah", "Olivia", "Paul", "Rosa", "Sam", "Tara", "Omar")
ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells", "cards", "balloons",
         "oranges", "toy cars", "coins", "flowers", "eggs")
CONTAINERS = ("boxes", "bags", "baskets", "jars", "packs", "trays")

Problem = tuple[str, list[str], int]  # question, worked steps, answer
Template = Callable[[random.Random, str, str, bool], Problem]  # (rng, who, item, easy)


def _add(r: random.Random, who: str, item: str, easy: bool = False) -> Problem:
    a, b = (r.randint(2, 10), r.randint(2, 10)) if easy else (r.randint(3, 40), r.randint(2, 30))
    q = f"{who} has {a} {item}. {who} gets {b} more {item}. How many {item} does {who} have now?"
    return q, [f"{a} + {b} = {a + b}"], a + b


def _subtract(r: random.Random, who: str, item: str, easy: bool = False) -> Problem:
    a = r.randint(5, 20) if easy else r.randint(10, 60)
    b = r.randint(2, a - 1)
    q = f"{who} had {a} {item} and gave {b} of them away. How many {item} does {who} have left?"
    return q, [f"{a} - {b} = {a - b}"], a - b


def _multiply(r: random.Random, who: str, item: str, easy: bool = False) -> Problem:
    a, b = (r.randint(2, 5), r.randint(2, 5)) if easy else (r.randint(2, 9), r.randint(2, 12))
    box = r.choice(CONTAINERS)
    q = f"{who} has {a} {box}. Each of them holds {b} {item}. How many {item} does {who} have in all?"
    return q, [f"{a} * {b} = {a * b}"], a * b


def _divide(r: random.Random, who: str, item: str, easy: bool = False) -> Problem:
    b, each = (r.randint(2, 5), r.randint(2, 5)) if easy else (r.randint(2, 9), r.randint(2, 10))
    a = b * each
    q = f"{who} shares {a} {item} equally among {b} friends. How many {item} does each friend get?"
    return q, [f"{a} / {b} = {each}"], each


def _add_then_subtract(r: random.Random, who: str, item: str, easy: bool = False) -> Problem:
    a, b = r.randint(5, 40), r.randint(2, 30)
    c = r.randint(2, a + b - 1)
    q = (f"{who} has {a} {item}, buys {b} more and then gives {c} to a friend. "
         f"How many {item} does {who} have now?")
    return q, [f"{a} + {b} = {a + b}", f"{a + b} - {c} = {a + b - c}"], a + b - c


def _multiply_then_add(r: random.Random, who: str, item: str, easy: bool = False) -> Problem:
    a, b, c = r.randint(2, 6), r.randint(2, 10), r.randint(1, 20)
    box = r.choice(CONTAINERS)
    q = (f"{who} buys {a} {box} of {item} with {b} {item} in each, and already had {c} {item}. "
         f"How many {item} does {who} have now?")
    return q, [f"{a} * {b} = {a * b}", f"{a * b} + {c} = {a * b + c}"], a * b + c


TEMPLATES: tuple[Template, ...] = (_add, _subtract, _multiply, _divide, _add_then_subtract, _multiply_then_add)
# level -> its templates; "easy" draws one operation on numbers up to 20 (products and dividends up to 25)
LEVELS: dict[str, tuple[Template, ...]] = {"mixed": TEMPLATES, "easy": (_add, _subtract, _multiply, _divide)}


def make_problems(n: int, seed: int = 0, level: str = "mixed") -> list[dict]:
    """``n`` distinct problems as GSM8K rows, drawn from ``random.Random(seed)`` over ``LEVELS[level]``."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if level not in LEVELS:
        raise ValueError(f"level must be one of {sorted(LEVELS)}, got {level!r}")
    templates, easy = LEVELS[level], level == "easy"
    r = random.Random(seed)
    rows, seen = [], set()
    for _ in range(n * 100):
        template = r.choice(templates)
        question, steps, answer = template(r, r.choice(NAMES), r.choice(ITEMS), easy)
        if question in seen:
            continue
        seen.add(question)
        rows.append({"question": question, "answer": "\n".join(steps) + f"\n#### {answer}"})
        if len(rows) == n:
            return rows
    raise ValueError(f"could not draw {n} distinct problems")  # pragma: no cover - the space is far larger


def write_problems(path: str | Path, n: int, seed: int = 0, level: str = "mixed") -> Path:
    """Write :func:`make_problems` as JSONL to ``path`` (parents created); returns the path."""
    rows = make_problems(n, seed, level)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path
