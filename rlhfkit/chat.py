"""`rlhfkit chat`: talk to a checkpoint in the terminal.

One process, no DeepSpeed: the model loads as a plain Hugging Face causal LM (CPU, or one GPU when
present), every turn goes through the tokenizer's chat template with the generation prompt, and the
reply streams token by token until EOS (never printed) or ``--max_new_tokens``.

Commands typed at the prompt: ``/reset`` clears the conversation (the system prompt stays),
``/quit`` (or ``/exit``, Ctrl-D) leaves, ``/help`` lists them. Ctrl-C during a reply stops it.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, TextIO

from rlhfkit.errors import CheckpointError, ConfigError

# Stages whose directory holds a causal LM that can chat; reward/critic hold a score head.
CHAT_STAGES = ("base", "sft", "dpo", "actor")
DEBUG_ENV = "RLHFKIT_CHAT_DEBUG_IDS"
HELP = "commands: /reset (clear the conversation), /quit or Ctrl-D (leave), /help"


@dataclass
class ChatOptions:
    """What ``rlhfkit chat`` was asked for (one field per flag)."""

    model: str
    max_new_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 0  # 0 = no top-k filtering
    greedy: bool = False
    system: Optional[str] = None
    seed: Optional[int] = None
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA) | fp32 | bf16 | fp16
    debug_ids: bool = False
    trust_remote_code: bool = False
    allow_pickle_weights: bool = False

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.greedy:
            if self.temperature <= 0:
                raise ConfigError(f"--temperature must be > 0 when sampling (got {self.temperature}); use --greedy for deterministic replies")
            if not 0 < self.top_p <= 1:
                raise ConfigError(f"--top_p must be in (0, 1], got {self.top_p}")
            if self.top_k < 0:
                raise ConfigError(f"--top_k must be >= 0 (0 disables it), got {self.top_k}")


# ----------------------------------------------------------------------------------------------
# loading


def check_chat_dir(path: str) -> dict:
    """The manifest of ``path`` if it holds a causal LM that can chat, else one clear error."""
    from pathlib import Path

    from rlhfkit.checkpoint import check_model_dir, read_manifest

    p = Path(path)
    if p.is_dir() and not (p / "config.json").exists():
        subs = [d for d in ("actor", "actor_ema") if (p / d / "config.json").exists()]
        if subs:
            raise CheckpointError(f"--model {path}: a step-3 output directory; chat with its policy: --model {p / subs[0]}")
    if p.is_dir() and (p / "config.json").exists():
        manifest = read_manifest(p) or {}
        stage = manifest.get("stage")
        if stage in ("reward", "critic"):
            raise CheckpointError(
                f"--model {path}: is a '{stage}' checkpoint (a sequence scorer with a value head, not a language model), "
                f"so it cannot chat; pass a {' / '.join(CHAT_STAGES)} checkpoint (e.g. step1/ or step3/actor/)")
        if not manifest:
            with open(p / "config.json", encoding="utf-8") as f:
                archs = json.load(f).get("architectures") or []
            if archs and all(a.endswith(("ForSequenceClassification", "ForTokenClassification")) for a in archs):
                raise CheckpointError(f"--model {path}: holds a {archs[0]} (a classifier, not a language model), so it cannot chat")
    return check_model_dir(path, CHAT_STAGES, "--model")


def pick_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible; use --device cpu")
    return name


def load_for_chat(opts: ChatOptions) -> tuple[Any, Any, str]:
    """(model in eval mode on its device, tokenizer, device)."""
    from rlhfkit.models import check_weights_policy, load_model, load_tokenizer

    check_chat_dir(opts.model)
    check_weights_policy(opts.model, opts.allow_pickle_weights, opts.trust_remote_code)  # before any file is read
    device = pick_device(opts.device)
    dtype = opts.dtype if opts.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
    tok = load_tokenizer(opts.model, trust_remote_code=opts.trust_remote_code, padding_side="left")
    if not getattr(tok, "chat_template", None):
        raise CheckpointError(
            f"--model {opts.model}: the tokenizer has no chat template (tokenizer_config.json / chat_template.jinja), "
            "so turns cannot be formatted; use a chat model or add a template")
    model = load_model(opts.model, "causal_lm", dtype=dtype, trust_remote_code=opts.trust_remote_code,
                       allow_pickle=opts.allow_pickle_weights, pad_token_id=tok.pad_token_id)
    model.to(device).eval()
    return model, tok, device


def eos_ids(model: Any, tok: Any) -> list[int]:
    """Every token that ends a reply: the tokenizer's EOS plus those of generation_config."""
    ids = [tok.eos_token_id]
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]
    return sorted({int(i) for i in ids if i is not None})


def context_limit(model: Any) -> Optional[int]:
    cfg = model.config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


# ----------------------------------------------------------------------------------------------
# the conversation


@dataclass
class Conversation:
    """The message history (system prompt first when given) and its token ids."""

    tokenizer: Any
    system: Optional[str] = None
    turns: list[dict] = field(default_factory=list)  # user/assistant messages, oldest first

    def messages(self, user: Optional[str] = None) -> list[dict]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        msgs += self.turns
        if user is not None:
            msgs.append({"role": "user", "content": user})
        return msgs

    def prompt_ids(self, user: str) -> list[int]:
        enc = self.tokenizer.apply_chat_template(self.messages(user), add_generation_prompt=True, tokenize=True, return_dict=True)
        ids = enc["input_ids"]
        return list(ids[0] if ids and isinstance(ids[0], list) else ids)

    def add(self, user: str, reply: str) -> None:
        self.turns += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]

    def drop_oldest_exchange(self) -> bool:
        if len(self.turns) < 2:
            return False
        del self.turns[:2]
        return True

    def reset(self) -> None:
        self.turns.clear()


def make_streamer(tokenizer: Any, out: TextIO):
    """A streamer writing decoded reply text to ``out`` as it arrives (special tokens such as EOS skipped)."""
    from transformers import TextStreamer

    class Streamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            out.write(text + ("\n" if stream_end else ""))
            out.flush()

    return Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


class ChatSession:
    """A model, a tokenizer and a conversation: :meth:`reply` runs one turn."""

    def __init__(self, model: Any, tokenizer: Any, device: str, opts: ChatOptions, out: TextIO = sys.stdout):
        from transformers import GenerationConfig

        self.model, self.tok, self.device, self.opts, self.out = model, tokenizer, device, opts, out
        self.conv = Conversation(tokenizer, opts.system)
        self.eos = eos_ids(model, tokenizer)
        self.max_ctx = context_limit(model)
        sampling = {} if opts.greedy else {"temperature": opts.temperature, "top_p": opts.top_p, "top_k": opts.top_k}
        self.gen = GenerationConfig(max_new_tokens=opts.max_new_tokens, do_sample=not opts.greedy, eos_token_id=self.eos,
                                    pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, **sampling)

    def _fit(self, user: str) -> Optional[list[int]]:
        """Prompt ids for ``user``, dropping the oldest exchanges until prompt + reply fits the context."""
        ids = self.conv.prompt_ids(user)
        if self.max_ctx is None:
            return ids
        dropped = 0
        while len(ids) + self.opts.max_new_tokens > self.max_ctx and self.conv.drop_oldest_exchange():
            dropped += 1
            ids = self.conv.prompt_ids(user)
        if dropped:
            self._say(f"[context full: dropped the {dropped} oldest exchange(s)]")
        if len(ids) + self.opts.max_new_tokens > self.max_ctx:
            self._say(f"[message too long: {len(ids)} prompt tokens + --max_new_tokens {self.opts.max_new_tokens} "
                      f"exceed the model's context of {self.max_ctx}; shorten it]")
            return None
        return ids

    def _say(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()

    def reply(self, user: str) -> Optional[str]:
        """Generate, stream and record the reply to ``user``; None when it was interrupted or did not fit."""
        import torch

        ids = self._fit(user)
        if ids is None:
            return None
        if self.opts.debug_ids:
            self._say("[ids] " + " ".join(map(str, ids)))
        input_ids = torch.tensor([ids], device=self.device)
        try:
            with torch.inference_mode():
                out = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                          generation_config=self.gen, streamer=make_streamer(self.tok, self.out))
        except KeyboardInterrupt:
            self._say("\n[interrupted: reply discarded]")
            return None
        new = out[0, len(ids):].tolist()
        ended = bool(new) and new[-1] in self.eos
        text = self.tok.decode(new, skip_special_tokens=True)
        if not ended:
            self._say(f"[stopped at --max_new_tokens {self.opts.max_new_tokens}]")
        if self.opts.debug_ids:
            self._say("[reply] " + json.dumps(text))  # ASCII-escaped: one parseable line
        self.conv.add(user, text)
        return text


# ----------------------------------------------------------------------------------------------
# the loop


def _read(prompt: str, out: TextIO) -> Optional[str]:
    """One line from the user; None on EOF / Ctrl-C at the prompt."""
    try:
        return input(prompt)
    except (EOFError, KeyboardInterrupt):
        out.write("\n")
        return None


def run_chat(opts: ChatOptions, out: TextIO = sys.stdout) -> None:
    opts.validate()
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        opts.debug_ids = True
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
    out.write(f"loading {opts.model} ...\n")
    out.flush()
    model, tok, device = load_for_chat(opts)
    if opts.seed is not None:
        from transformers import set_seed

        set_seed(opts.seed)
    session = ChatSession(model, tok, device, opts, out)
    mode = "greedy" if opts.greedy else f"temperature {opts.temperature}, top_p {opts.top_p}, top_k {opts.top_k or 'off'}"
    out.write(f"ready on {device} ({mode}, up to {opts.max_new_tokens} new tokens). {HELP}\n")
    out.flush()
    while True:
        line = _read("\n>>> ", out)
        if line is None:
            break
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd = text.split()[0].lower()
            if cmd in ("/quit", "/exit", "/q"):
                break
            if cmd == "/reset":
                session.conv.reset()
                out.write("[conversation cleared]\n")
            elif cmd in ("/help", "/?"):
                out.write(HELP + "\n")
            else:
                out.write(f"unknown command {cmd}; {HELP}\n")
            out.flush()
            continue
        session.reply(text)
    out.write("bye\n")
    out.flush()


def options_from_args(args: Any) -> ChatOptions:
    return ChatOptions(**{k: getattr(args, k) for k in ChatOptions.__dataclass_fields__})


__all__ = ["CHAT_STAGES", "ChatOptions", "ChatSession", "Conversation", "check_chat_dir", "run_chat"]
