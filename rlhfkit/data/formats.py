"""What the rows of a source mean: format detection and row -> :class:`Example` conversion.

The format of a source is detected once, from the field names of its first rows (their union, so
that a few rows missing a field do not change the verdict), and every row is then converted by that
format's function. A row that cannot serve the step's ``need`` raises :class:`Skip` with a short,
countable reason ("missing field 'rejected'", "empty response", "chosen == rejected", ...).

``need`` is what the training step uses:
  "sft"     a prompt and a response (``chosen``)         -> step 1
  "pairs"   a prompt, chosen and rejected, not equal     -> step 2 (and DPO)
  "prompts" a prompt only                                -> step 3
  "labelled" a prompt and a desirable (``chosen``) and/or undesirable (``rejected``) completion -> KTO:
            a pair gives one of each, a ``{"prompt", "completion", "label": true|false}`` row one
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from rlhfkit.data.sources import FORMATS_HELP, BadRow, RawSource
from rlhfkit.errors import DataError

NEEDS = ("sft", "pairs", "prompts", "labelled")

Messages = list[dict[str, str]]


@dataclass
class Example:
    """One usable row, in chat form."""

    prompt: Messages  # [{"role": "system"|"user"|"assistant", "content": str}], ends with a user turn
    chosen: str | None  # the (preferred) response; None for prompt-only rows
    rejected: str | None  # the dispreferred response; None unless a pair
    meta: dict  # {"source": path, "row": 0-based row} + the row's other fields as they are


def with_prompt_suffix(examples: list[Example], suffix: str) -> list[Example]:
    """The examples with ``suffix`` appended to their last user turn (e.g. an answer-format
    instruction for GSM8K, as verl's data preparation adds one); the rows (``meta``) are unchanged."""
    out = []
    for ex in examples:
        prompt = [dict(m) for m in ex.prompt]
        last_user = max(i for i, m in enumerate(prompt) if m["role"] == "user")
        prompt[last_user]["content"] = prompt[last_user]["content"].rstrip() + " " + suffix.strip()
        out.append(Example(prompt, ex.chosen, ex.rejected, ex.meta))
    return out


class Skip(Exception):
    """This row cannot be used; ``reason`` is short and countable, ``detail`` is for messages."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


# A converter turns one raw row into (prompt, chosen, rejected, extra meta) for a ``need``.
Converter = Callable[[Any, str], tuple[Messages, "str | None", "str | None", dict]]


@dataclass(frozen=True)
class Format:
    name: str
    provides: str  # the most it can feed: "pairs" > "sft" > "prompts"
    convert: Converter


# ---------------------------------------------------------------------------------------------
# field helpers

_ROLES = {
    "system": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "bot": "assistant", "model": "assistant",
    "chatgpt": "assistant",
}


def _field(row: dict, key: str, required: bool) -> Any:
    """row[key]; a missing (or null) field raises Skip when required, else gives None."""
    value = row.get(key)
    if value is None and required:
        raise Skip(f"missing field {key!r}")
    return value


def _text(row: dict, key: str, required: bool) -> str | None:
    value = _field(row, key, required)
    if value is not None and not isinstance(value, str):
        raise Skip(f"wrong type for {key!r}", f"{type(value).__name__}, expected a string")
    return value


def _messages(value: Any, key: str) -> Messages:
    """A list of {"role", "content"} or {"from", "value"} dicts -> chat messages."""
    if not isinstance(value, list):
        raise Skip(f"wrong type for {key!r}", f"{type(value).__name__}, expected a list of messages")
    out = []
    for m in value:
        if not isinstance(m, dict):
            raise Skip(f"wrong type for {key!r}", "a message is not an object")
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value"))
        if role not in _ROLES:
            raise Skip(f"unknown role in {key!r}", f"{role!r}; known: {', '.join(sorted(_ROLES))}")
        if not isinstance(content, str):
            raise Skip(f"wrong type for {key!r}", f"message content is {type(content).__name__}")
        out.append({"role": _ROLES[role], "content": content.strip()})
    return out


def _response(row: dict, key: str, required: bool) -> str | None:
    """A response: a string, a {"from"/"role", "value"/"content"} message, or a message list."""
    value = _field(row, key, required)
    if value is None or isinstance(value, str):
        return None if value is None else value.strip()
    if isinstance(value, dict):
        value = [value]
    messages = _messages(value, key)
    if not messages or messages[-1]["role"] != "assistant":
        raise Skip(f"wrong type for {key!r}", "expected a string or an assistant message")
    return messages[-1]["content"]


_HH_TURN = re.compile(r"\n\n(Human|Assistant):")
_LOOSE_TURN = re.compile(r"(?:^|\s+)(Human|Assistant):")


def parse_dialogue(text: str) -> Messages:
    """``"\\n\\nHuman: a\\n\\nAssistant: b\\n\\nHuman: c"`` -> chat messages (contents stripped).

    Turns are split at ``"\\n\\nHuman:"`` / ``"\\n\\nAssistant:"`` (hh-rlhf); a text without them
    but starting with ``Human:`` is split at any ``Human:`` / ``Assistant:`` after whitespace
    (DeepSpeed-Chat's ``" Human: ... Assistant:"`` prompts). A trailing empty assistant turn (the
    generation prompt) is dropped.
    """
    pattern = _HH_TURN if _HH_TURN.search(text) else _LOOSE_TURN
    pieces = pattern.split(text)
    if pieces[0].strip() or len(pieces) < 3:
        raise Skip("not an hh-rlhf dialogue", "text does not start with 'Human:'")
    messages = [
        {"role": "user" if who == "Human" else "assistant", "content": said.strip()}
        for who, said in zip(pieces[1::2], pieces[2::2])
    ]
    if messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
        messages.pop()
    return messages


def _prompt(value: Any, key: str = "prompt") -> Messages:
    """A prompt field: a plain string (one user turn, or an hh-style dialogue) or messages."""
    if isinstance(value, str):
        if re.match(r"\s*Human:", value):
            return parse_dialogue(value)
        return [{"role": "user", "content": value.strip()}]
    return _messages(value, key)


def _other_fields(row: dict, used: tuple[str, ...]) -> dict:
    return {k: v for k, v in row.items() if k not in used}


def _wants(need: str) -> tuple[bool, bool]:
    """(chosen required, rejected required) for a need."""
    return need in ("sft", "pairs"), need == "pairs"


# ---------------------------------------------------------------------------------------------
# converters, one per format


def _hh_rlhf(row: dict, need: str):
    """hh-rlhf: chosen/rejected are whole dialogues sharing all turns before the last answer."""
    _, want_rejected = _wants(need)
    chosen_text = _text(row, "chosen", required=True)  # the prompt comes from it
    rejected_text = _text(row, "rejected", required=want_rejected)
    cut = chosen_text.rfind("\n\nAssistant:")
    if cut < 0:
        raise Skip("not an hh-rlhf dialogue", "'chosen' has no '\\n\\nAssistant:' turn")
    prompt = parse_dialogue(chosen_text[:cut])
    chosen = chosen_text[cut + len("\n\nAssistant:"):].strip()
    rejected = None
    if rejected_text is not None:
        rcut = rejected_text.rfind("\n\nAssistant:")
        if rcut < 0 or rejected_text[:rcut] != chosen_text[:cut]:
            if want_rejected:
                raise Skip("chosen and rejected differ before the last assistant turn")
        else:
            rejected = rejected_text[rcut + len("\n\nAssistant:"):].strip()
    return prompt, chosen, rejected, _other_fields(row, ("chosen", "rejected"))


def _prompt_chosen_rejected(row: dict, need: str):
    want_chosen, want_rejected = _wants(need)
    prompt = _prompt(_field(row, "prompt", required=True))
    chosen = _response(row, "chosen", want_chosen)
    rejected = _response(row, "rejected", want_rejected)
    return prompt, chosen, rejected, _other_fields(row, ("prompt", "chosen", "rejected"))


def _prompt_response(row: dict, need: str):
    want_chosen, _ = _wants(need)
    prompt = _prompt(_field(row, "prompt", required=True))
    chosen = _response(row, "response", want_chosen)
    return prompt, chosen, None, _other_fields(row, ("prompt", "response"))


def _instruction_prompt(row: dict, instruction: str, input_text: Any) -> Messages:
    if input_text is not None and not isinstance(input_text, str):
        raise Skip("wrong type for 'input'", f"{type(input_text).__name__}, expected a string")
    text = instruction.strip()
    if input_text and input_text.strip():
        text = f"{text}\n\n{input_text.strip()}"
    messages: Messages = []
    system = _text(row, "system", required=False)
    if system and system.strip():
        messages.append({"role": "system", "content": system.strip()})
    history = row.get("history") or []
    if not isinstance(history, list) or not all(isinstance(h, list) and len(h) == 2 for h in history):
        raise Skip("wrong type for 'history'", "expected a list of [query, answer] pairs")
    for query, answer in history:
        if not isinstance(query, str) or not isinstance(answer, str):
            raise Skip("wrong type for 'history'", "expected strings")
        messages += [{"role": "user", "content": query.strip()},
                     {"role": "assistant", "content": answer.strip()}]
    return messages + [{"role": "user", "content": text}]


def _alpaca(row: dict, need: str):
    """Alpaca (and LLaMA-Factory's alpaca layout): instruction + input -> output, or chosen/rejected."""
    want_chosen, want_rejected = _wants(need)
    prompt = _instruction_prompt(row, _text(row, "instruction", True), row.get("input"))
    key = "output" if "output" in row or "chosen" not in row else "chosen"
    chosen = _response(row, key, want_chosen)
    rejected = _response(row, "rejected", want_rejected)
    used = ("instruction", "input", "output", "chosen", "rejected", "system", "history")
    return prompt, chosen, rejected, _other_fields(row, used)


def _sharegpt(row: dict, need: str):
    """ShareGPT / LLaMA-Factory: conversations [{from, value}] (+ chosen/rejected), or messages."""
    want_chosen, want_rejected = _wants(need)
    key = "conversations" if "conversations" in row else "messages"
    messages = _messages(_field(row, key, required=True), key)
    system = _text(row, "system", required=False)
    if system and system.strip() and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system.strip()})
    if "chosen" in row or "rejected" in row:  # preference layout: the conversation is the prompt
        chosen = _response(row, "chosen", want_chosen)
        rejected = _response(row, "rejected", want_rejected)
    elif messages and messages[-1]["role"] == "assistant":  # SFT layout: the last answer
        chosen, rejected = messages.pop()["content"], None
        if want_rejected:
            raise Skip("missing field 'rejected'")
    else:
        chosen = rejected = None
        if want_chosen:
            raise Skip(f"no assistant answer at the end of {key!r}")
    used = (key, "system", "chosen", "rejected")
    return messages, chosen, rejected, _other_fields(row, used)


def _seed_task(row: dict, need: str):
    """self-instruct / BELLE seed tasks: instruction + the first of ``instances``."""
    want_chosen, _ = _wants(need)
    instruction = _text(row, "instruction", required=True)
    instances = _field(row, "instances", required=True)
    if not isinstance(instances, list) or not instances or not isinstance(instances[0], dict):
        raise Skip("wrong type for 'instances'", "expected a non-empty list of {input, output}")
    first = instances[0]
    prompt = _instruction_prompt({}, instruction, first.get("input"))
    chosen = _text(first, "output", want_chosen)
    chosen = chosen.strip() if chosen is not None else None
    return prompt, chosen, None, _other_fields(row, ("instruction", "instances"))


def _gsm8k(row: dict, need: str):
    """GSM8K: question -> answer (worked solution ending in '#### n'); meta['answer'] keeps it."""
    want_chosen, _ = _wants(need)
    question = _text(row, "question", required=True)
    answer = _text(row, "answer", required=want_chosen)
    meta = _other_fields(row, ("question",))
    return [{"role": "user", "content": question.strip()}], answer and answer.strip(), None, meta


def _mgsm_tsv(row: Any, need: str):
    """MGSM TSV without header: [question, number]; meta['answer'] = the number (no response)."""
    if not isinstance(row, list):
        raise Skip("wrong type", f"row is {type(row).__name__}, expected TSV cells")
    if len(row) != 2:
        raise Skip("wrong number of columns", f"{len(row)} columns, expected question<TAB>number")
    question, number = row
    return [{"role": "user", "content": question.strip()}], None, None, {"answer": number.strip()}


def _prompt_only(row: dict, need: str):
    prompt = _prompt(_field(row, "prompt", required=True))
    return prompt, None, None, _other_fields(row, ("prompt",))


def _prompt_completion_label(row: dict, need: str):
    """KTO's unpaired rows: the completion is desirable (label true) or undesirable (false)."""
    prompt = _prompt(_field(row, "prompt", required=True))
    completion = _response(row, "completion", required=True)
    label = _field(row, "label", required=True)
    if label not in (True, False, 0, 1):
        raise Skip("bad label", f"'label' must be true or false, got {label!r}")
    good = bool(label)
    return prompt, completion if good else None, None if good else completion, _other_fields(row, ("prompt", "completion", "label"))


def _plain_string(row: Any, need: str):
    if not isinstance(row, str):
        raise Skip("wrong type", f"row is {type(row).__name__}, expected a string")
    return _prompt(row), None, None, {}


FORMATS = {
    f.name: f
    for f in (
        Format("hh-rlhf", "pairs", _hh_rlhf),
        Format("prompt/chosen/rejected", "pairs", _prompt_chosen_rejected),
        Format("prompt/response", "sft", _prompt_response),
        Format("prompt/completion/label", "labelled", _prompt_completion_label),
        Format("alpaca", "sft", _alpaca),
        Format("alpaca-pairs", "pairs", _alpaca),
        Format("sharegpt", "sft", _sharegpt),
        Format("sharegpt-pairs", "pairs", _sharegpt),
        Format("seed-tasks", "sft", _seed_task),
        Format("gsm8k", "sft", _gsm8k),
        Format("mgsm-tsv", "prompts", _mgsm_tsv),
        Format("prompt-only", "prompts", _prompt_only),
        Format("strings", "prompts", _plain_string),
    )
}


def _format_for_keys(keys: set[str]) -> str | None:
    if keys & {"conversations", "messages"}:
        return "sharegpt-pairs" if {"chosen", "rejected"} & keys else "sharegpt"
    if "prompt" in keys:
        if keys & {"chosen", "rejected"}:
            return "prompt/chosen/rejected"
        if {"completion", "label"} <= keys:
            return "prompt/completion/label"
        return "prompt/response" if "response" in keys else "prompt-only"
    if "instruction" in keys:
        if "instances" in keys:
            return "seed-tasks"
        if "rejected" in keys:
            return "alpaca-pairs"
        if keys & {"output", "chosen"}:
            return "alpaca"
        return None
    if {"chosen", "rejected"} <= keys:
        return "hh-rlhf"
    if {"question", "answer"} <= keys:
        return "gsm8k"
    return None


def detect_format(raw: RawSource, sample: int = 1000) -> Format:
    """The format of a source, from its first ``sample`` parsable rows; DataError if unknown."""
    rows = [r for r in raw.rows[:sample] if not isinstance(r, BadRow)]
    if not rows:
        first = raw.rows[0] if raw.rows else None
        why = "it has no rows"
        if first is not None:
            why = f"its first rows cannot be parsed ({first.reason}: {first.detail})"
        raise DataError(f"{raw.path}: cannot use this data: {why}.\n{FORMATS_HELP}")
    dicts = [r for r in rows if isinstance(r, dict)]
    if dicts:
        keys = set().union(*(d.keys() for d in dicts))
        name = _format_for_keys(keys)
        if name is None:
            raise DataError(
                f"{raw.path}: unknown data format ({raw.container}); fields found: "
                f"{', '.join(sorted(keys))}.\n{FORMATS_HELP}"
            )
        return FORMATS[name]
    if all(isinstance(r, str) for r in rows):
        return FORMATS["strings"]
    if all(isinstance(r, list) and all(isinstance(c, str) for c in r) for r in rows):
        widths = sorted(len(r) for r in rows)
        if widths[len(widths) // 2] == 2:
            return FORMATS["mgsm-tsv"]
    kinds = sorted({type(r).__name__ for r in rows})
    raise DataError(
        f"{raw.path}: unknown data format ({raw.container}); rows are {', '.join(kinds)}, "
        f"not objects with known fields.\n{FORMATS_HELP}"
    )


def convert_row(fmt: Format, raw: RawSource, row: int, need: str) -> Example:
    """Raw row -> Example usable for ``need``, or raise Skip with the reason."""
    value = raw.rows[row]
    if isinstance(value, BadRow):
        raise Skip(value.reason, value.detail)
    if fmt.name not in ("mgsm-tsv", "strings") and not isinstance(value, dict):
        raise Skip("wrong type", f"row is {type(value).__name__}, expected a JSON object")
    prompt, chosen, rejected, extra = fmt.convert(value, need)
    if not prompt or prompt[-1]["role"] != "user":
        raise Skip("prompt does not end with a user turn")
    if not prompt[-1]["content"]:
        raise Skip("empty prompt")
    if need in ("sft", "pairs") and not chosen:
        raise Skip("empty response", "'chosen' is empty")
    if need == "labelled" and not (chosen or rejected):
        raise Skip("empty response", "no desirable or undesirable completion")
    if need in ("pairs", "labelled") and chosen and chosen == rejected:
        raise Skip("chosen == rejected")
    if need == "pairs":
        if not rejected:
            raise Skip("empty response", "'rejected' is empty")
        if chosen == rejected:
            raise Skip("chosen == rejected")
    return Example(prompt, chosen, rejected, {"source": raw.path, "row": row, **extra})
