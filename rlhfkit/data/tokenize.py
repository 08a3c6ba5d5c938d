"""Examples -> token ids for each step, with truncation that is counted, never silent.

Prompts go through the tokenizer's chat template with the generation prompt (the assistant
header) at the end; a response is its text's tokens followed by EOS, so every complete response
ends with ``eos_token_id``. Prompt and response are tokenised separately and concatenated, so the
prompt/response boundary is exact.

Truncation to ``max_seq_len`` L (SFT and pairs): keep the response whole if possible by cutting
the prompt from the left, but keep at least min(len(prompt), L // 2) prompt tokens; then cut the
response from the right to fit (it then has no EOS). RL prompts longer than ``max_prompt_len``
lose their earliest turns (a system message stays) at a user-turn boundary, or are dropped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Sequence

from rlhfkit.algos import IGNORE_INDEX  # noqa: F401 - the label of tokens that carry no loss (prompt, padding)
from rlhfkit.data.formats import Example, Messages
from rlhfkit.errors import ConfigError, DataError

FIRST_DROPS = 5


@dataclass
class TokenizeReport:
    examples: int  # examples given
    kept: int  # features returned
    prompt_truncated: int  # kept examples whose prompt was cut
    response_truncated: int  # kept examples with a response cut (it then has no EOS)
    dropped: dict[str, int]  # reason -> count
    first_drops: list[tuple[int, str]] = field(default_factory=list)  # first few (index, reason)

    def summary(self) -> str:
        line = (
            f"tokenised {self.examples} examples: kept {self.kept}, prompt truncated "
            f"{self.prompt_truncated}, response truncated {self.response_truncated}"
        )
        if not self.dropped:
            return line + ", none dropped"
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(self.dropped.items(), key=lambda x: -x[1]))
        return f"{line}, dropped {sum(self.dropped.values())} ({reasons})"


class _Drop(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def plain_prompt_text(messages: Messages) -> str:
    """The fallback prompt format for tokenizers without a chat template:
    ``"Human: ...\\n\\nAssistant: ...\\n\\nHuman: ...\\n\\nAssistant:"`` (a system message first, as is)."""
    names = {"user": "Human: ", "assistant": "Assistant: ", "system": ""}
    return "".join(f"{names[m['role']]}{m['content']}\n\n" for m in messages) + "Assistant:"


def encode_prompt(tokenizer, messages: Messages) -> list[int]:
    """Prompt token ids, ending with the assistant header the response follows."""
    if getattr(tokenizer, "chat_template", None):
        ids: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    else:
        ids = tokenizer(plain_prompt_text(messages))
    if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):  # BatchEncoding (transformers >= 5)
        ids = ids["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(i) for i in ids]


def encode_response(tokenizer, text: str) -> list[int]:
    """Response token ids + EOS (EOS always ends a complete response)."""
    if tokenizer.eos_token_id is None:
        raise ConfigError("the tokenizer has no EOS token; set tokenizer.eos_token before training.")
    return list(tokenizer(text, add_special_tokens=False).input_ids) + [tokenizer.eos_token_id]


def _prompt_keep(prompt_len: int, response_lens: Sequence[int], max_seq_len: int) -> int:
    """How many (rightmost) prompt tokens to keep so that the longest response fits if it can."""
    longest = max(response_lens)
    if prompt_len + longest <= max_seq_len:
        return prompt_len
    keep = max(min(prompt_len, max_seq_len // 2), max_seq_len - longest)
    if keep >= max_seq_len:
        raise _Drop("prompt leaves no room for a response")
    return keep


def _run(examples, per_example) -> tuple[list[dict], TokenizeReport]:
    """Apply ``per_example(i, ex, counts) -> feature`` to each example, collecting drops."""
    features: list[dict] = []
    dropped: Counter[str] = Counter()
    first: list[tuple[int, str]] = []
    counts = Counter()
    for i, ex in enumerate(examples):
        try:
            features.append(per_example(i, ex, counts))
        except _Drop as d:
            dropped[d.reason] += 1
            if len(first) < FIRST_DROPS:
                first.append((i, d.reason))
    report = TokenizeReport(len(examples), len(features), counts["prompt"], counts["response"],
                            dict(dropped), first)
    if examples and not features:
        raise DataError(f"no example survived tokenisation: {report.summary()}; "
                        f"first dropped: {first}. Raise the length limit or check the data.")
    return features, report


def tokenize_by_source(tokenize, examples: Sequence[Example], tokenizer, max_seq_len: int
                       ) -> tuple[list[dict], TokenizeReport]:
    """``tokenize`` over each data source's examples apart (``ex.meta["source"]``), in the order the sources
    first appear, each feature tagged with its source's path as ``feature["source"]``: held-out figures
    per preference set. One report for all; a drop's index counts from the first example given."""
    groups: dict[str, list[int]] = {}
    for i, ex in enumerate(examples):
        groups.setdefault(ex.meta.get("source", ""), []).append(i)
    features: list[dict] = []
    total = TokenizeReport(len(examples), 0, 0, 0, {})
    for source, index in groups.items():
        part, report = tokenize([examples[i] for i in index], tokenizer, max_seq_len)
        features += [{**f, "source": source} for f in part]
        total.kept += report.kept
        total.prompt_truncated += report.prompt_truncated
        total.response_truncated += report.response_truncated
        for reason, n in report.dropped.items():
            total.dropped[reason] = total.dropped.get(reason, 0) + n
        total.first_drops += [(index[i], why) for i, why in report.first_drops]
    total.first_drops = sorted(total.first_drops)[:FIRST_DROPS]
    return features, total


def _prompt_ids(tokenizer, ex: Example) -> list[int]:
    try:
        return encode_prompt(tokenizer, ex.prompt)
    except Exception as e:  # a chat template may reject a message list (roles must alternate, ...)
        raise _Drop(f"chat template error: {type(e).__name__}") from e


def _check_len(name: str, value: int, least: int) -> None:
    if not isinstance(value, int) or value < least:
        raise ConfigError(f"{name} must be an integer >= {least}, not {value!r}")


def tokenize_sft(
    examples: Sequence[Example], tokenizer, max_seq_len: int
) -> tuple[list[dict], TokenizeReport]:
    """-> features {"input_ids", "labels"}: labels are IGNORE_INDEX on every prompt token and equal
    input_ids on the response and its EOS."""
    _check_len("max_seq_len", max_seq_len, 2)

    def one(i, ex, counts):
        if not ex.chosen:
            raise _Drop("no response")
        prompt = _prompt_ids(tokenizer, ex)
        response = encode_response(tokenizer, ex.chosen)
        keep = _prompt_keep(len(prompt), [len(response)], max_seq_len)
        room = max_seq_len - keep
        counts["prompt"] += keep < len(prompt)
        counts["response"] += len(response) > room
        prompt, response = prompt[len(prompt) - keep:], response[:room]
        return {"input_ids": prompt + response, "labels": [IGNORE_INDEX] * len(prompt) + response}

    return _run(examples, one)


def tokenize_pairs(
    examples: Sequence[Example], tokenizer, max_seq_len: int
) -> tuple[list[dict], TokenizeReport]:
    """-> features {"chosen_input_ids", "rejected_input_ids", "prompt_len"}; both sequences share
    the same (possibly left-cut) prompt of prompt_len tokens."""
    _check_len("max_seq_len", max_seq_len, 2)

    def one(i, ex, counts):
        if not ex.chosen or not ex.rejected:
            raise _Drop("no chosen/rejected pair")
        prompt = _prompt_ids(tokenizer, ex)
        chosen = encode_response(tokenizer, ex.chosen)
        rejected = encode_response(tokenizer, ex.rejected)
        keep = _prompt_keep(len(prompt), [len(chosen), len(rejected)], max_seq_len)
        room = max_seq_len - keep
        prompt_cut = keep < len(prompt)
        response_cut = max(len(chosen), len(rejected)) > room
        prompt = prompt[len(prompt) - keep:]
        chosen_ids, rejected_ids = prompt + chosen[:room], prompt + rejected[:room]
        if chosen_ids == rejected_ids:
            raise _Drop("identical after truncation")
        counts["prompt"] += prompt_cut
        counts["response"] += response_cut
        return {"chosen_input_ids": chosen_ids, "rejected_input_ids": rejected_ids, "prompt_len": keep}

    return _run(examples, one)


def tokenize_kto(
    examples: Sequence[Example], tokenizer, max_seq_len: int
) -> tuple[list[dict], TokenizeReport]:
    """-> KTO features {"prompt_ids", "completion_ids", "desirable", "max_seq_len"}: a pair gives two (its chosen
    desirable, its rejected undesirable, side by side), a labelled row one. The report counts examples."""
    _check_len("max_seq_len", max_seq_len, 2)

    def one(i, ex, counts):
        sides = [(text, good) for text, good in ((ex.chosen, True), (ex.rejected, False)) if text]
        if not sides:
            raise _Drop("no completion")
        prompt = _prompt_ids(tokenizer, ex)
        completions = [encode_response(tokenizer, text) for text, _ in sides]
        keep = _prompt_keep(len(prompt), [len(c) for c in completions], max_seq_len)
        room = max_seq_len - keep
        counts["prompt"] += keep < len(prompt)
        counts["response"] += max(len(c) for c in completions) > room
        prompt = prompt[len(prompt) - keep:]
        return [{"prompt_ids": prompt, "completion_ids": c[:room], "desirable": good, "max_seq_len": max_seq_len}
                for c, (_, good) in zip(completions, sides)]

    nested, report = _run(examples, one)
    return [f for sides in nested for f in sides], report


def tokenize_prompts(
    examples: Sequence[Example], tokenizer, max_prompt_len: int
) -> tuple[list[dict], TokenizeReport]:
    """-> features {"prompt_ids", "index"} (index into ``examples``). A prompt longer than
    max_prompt_len loses its earliest turns, cut where a user turn starts (a leading system message
    is kept); if even its last user turn alone is too long, the example is dropped."""
    _check_len("max_prompt_len", max_prompt_len, 1)

    def one(i, ex, counts):
        ids = _prompt_ids(tokenizer, ex)
        if len(ids) > max_prompt_len:
            messages = ex.prompt
            system = messages[:1] if messages[0]["role"] == "system" else []
            turns = messages[len(system):]
            starts = [j for j, m in enumerate(turns) if j > 0 and m["role"] == "user"]
            for j in starts:
                ids = _prompt_ids(tokenizer, Example(system + turns[j:], None, None, {}))
                if len(ids) <= max_prompt_len:
                    counts["prompt"] += 1
                    break
            else:
                raise _Drop("prompt too long even with only its last user turn")
        return {"prompt_ids": ids, "index": i}

    return _run(examples, one)
