"""Rule-based (verifiable) rewards and the loader for custom reward functions.

A reward function takes ``(prompts: list[str], responses: list[str], rows: list[dict])`` — the
prompt text, the decoded response, and each sample's dataset row (``Example.meta``: e.g. GSM8K's
``answer``) — and returns one float per sample. Built in: ``gsm8k``. Custom ones are given as
``module.path:function`` and imported from that module only.
"""

from __future__ import annotations

import importlib
import math
import re
from typing import Any, Callable, Optional

from rlhfkit.errors import ConfigError, RlhfkitError

RewardFn = Callable[[list, list, list], list]

_NUMBER = r"-?[\d,]*\.?\d+"


def _to_float(text: str) -> Optional[float]:
    try:
        return float(text.replace(",", "").rstrip("."))
    except ValueError:
        return None


def extract_answer(text: str) -> Optional[float]:
    """The final numeric answer of a response: ``#### n``, else ``\\boxed{n}``, else the last number.
    None when there is no (Arabic-numeral) number at all."""
    m = re.search(r"####\s*\$?\s*(" + _NUMBER + ")", text)
    if m:
        return _to_float(m.group(1))
    m = re.findall(r"\\boxed\{\s*\$?\s*(" + _NUMBER + r")\s*\}", text)
    if m:
        return _to_float(m[-1])
    nums = re.findall(_NUMBER, text)
    return _to_float(nums[-1]) if nums else None


def reference_answer(row: dict) -> Optional[float]:
    """The gold number of a GSM8K row (``answer`` ending in ``#### n``) or an MGSM row (a number)."""
    ans = row.get("answer")
    if ans is None:
        return None
    return extract_answer(str(ans))


def has_answer_format(text: str) -> bool:
    return bool(re.search(r"####\s*\$?\s*" + _NUMBER, text) or re.search(r"\\boxed\{[^}]*\}", text))


def gsm8k_parts(responses: list, rows: list) -> tuple[list, list]:
    """Per sample: 1.0 for an exact numeric match of the final answer (else 0.0), and 1.0 when the
    response states its answer as ``#### n`` or ``\\boxed{n}`` (else 0.0)."""
    correct, formatted = [], []
    for response, row in zip(responses, rows):
        gold = reference_answer(row)
        if gold is None:
            raise RlhfkitError("the gsm8k reward needs an 'answer' field in each data row (GSM8K or MGSM files)")
        pred = extract_answer(response)
        correct.append(1.0 if pred is not None and abs(pred - gold) < 1e-6 else 0.0)
        formatted.append(1.0 if has_answer_format(response) else 0.0)
    return correct, formatted


def gsm8k_reward(prompts: list, responses: list, rows: list, format_bonus: float = 0.0,
                 parts: Optional[dict] = None) -> list:
    """1 for an exact numeric match of the final answer, else 0; plus ``format_bonus`` when the
    response states its answer as ``#### n`` or ``\\boxed{n}``. With ``parts`` (a dict), the two
    per-sample components are appended to ``parts["gsm8k_accuracy"]`` and ``parts["gsm8k_format"]``."""
    correct, formatted = gsm8k_parts(responses, rows)
    if parts is not None:
        parts.setdefault("gsm8k_accuracy", []).extend(correct)
        parts.setdefault("gsm8k_format", []).extend(formatted)
    return [c + format_bonus * f for c, f in zip(correct, formatted)]


BUILTIN: dict[str, RewardFn] = {"gsm8k": gsm8k_reward}


def load_reward_fn(name: str) -> RewardFn:
    """``gsm8k`` or ``package.module:function`` (imported from that module only)."""
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise ConfigError(f"--reward_fn {name}: not a built-in ({', '.join(BUILTIN)}) and not of the form module.path:function")
    module_name, fn_name = name.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"--reward_fn {name}: cannot import module {module_name} ({e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"--reward_fn {name}: {module_name} has no function {fn_name}")
    return fn


def call_reward_fn(name: str, fn: RewardFn, prompts: list, responses: list, rows: list, **kwargs: Any) -> list:
    """Call ``fn`` on a batch; any exception becomes one clear error naming the function and the sample."""
    try:
        scores = fn(prompts, responses, rows, **kwargs)
    except RlhfkitError:
        raise
    except Exception as e:  # noqa: BLE001 - user code: report it, do not crash deep inside the loop
        sample = ""
        for i in range(len(responses)):  # find the first sample that fails on its own
            try:
                fn(prompts[i:i + 1], responses[i:i + 1], rows[i:i + 1], **kwargs)
            except Exception:  # noqa: BLE001
                sample = f" on sample {i} (prompt {prompts[i][:80]!r}, response {responses[i][:80]!r})"
                break
        raise RlhfkitError(f"reward function {name} raised {type(e).__name__}: {e}{sample}") from None
    if len(scores) != len(responses):
        raise RlhfkitError(f"reward function {name} returned {len(scores)} scores for {len(responses)} samples")
    out = [float(s) for s in scores]
    for i, s in enumerate(out):
        if not math.isfinite(s):
            raise RlhfkitError(f"reward function {name} returned {s} for sample {i} (prompt {prompts[i][:80]!r}, response "
                               f"{responses[i][:80]!r}): rewards must be finite numbers")
    return out
