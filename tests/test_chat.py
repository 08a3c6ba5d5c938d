"""`rlhfkit chat`: the chat template reaches generate, turns accumulate, /reset clears, EOS ends a reply."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys

import pytest
import torch

from rlhfkit.chat import ChatOptions, ChatSession, Conversation, run_chat
from rlhfkit.cli import main
from testutils import REPO

SYSTEM = "You are a terse test assistant."


def template_ids(tok, messages):
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


def test_chat_in_a_terminal(tiny_dir, tokenizer):
    """Two turns, /reset, one turn, /quit through a pseudo-terminal; the ids sent to generate are the template's."""
    pexpect = pytest.importorskip("pexpect")
    env = dict(os.environ, TERM="dumb", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = pexpect.spawn(sys.executable, ["-m", "rlhfkit.cli", "chat", "--model", str(tiny_dir), "--max_new_tokens", "5",
                                           "--greedy", "--system", SYSTEM, "--debug_ids"],
                          env=env, encoding="utf-8", timeout=180, dimensions=(24, 4000))
    log = io.StringIO()
    child.logfile_read = log

    def turn(text):
        child.expect_exact(">>> ")
        child.sendline(text)
        child.expect(r"\[ids\] ([0-9 ]+)\r?\n")
        ids = [int(t) for t in child.match.group(1).split()]
        child.expect(r"\[reply\] (\"[^\r\n]*\")\r?\n")
        return ids, json.loads(child.match.group(1))

    try:
        child.expect("ready on cpu")
        history = [{"role": "system", "content": SYSTEM}]

        ids1, reply1 = turn("Hello, who are you?")
        assert ids1 == template_ids(tokenizer, history + [{"role": "user", "content": "Hello, who are you?"}])
        history += [{"role": "user", "content": "Hello, who are you?"}, {"role": "assistant", "content": reply1}]

        ids2, reply2 = turn("Tell me more.")
        assert ids2 == template_ids(tokenizer, history + [{"role": "user", "content": "Tell me more."}])
        text2 = tokenizer.decode(ids2)  # the first exchange is part of the second prompt
        assert text2.startswith(tokenizer.decode(ids1)) and "Hello, who are you?" in text2 and reply1 in text2

        child.expect_exact(">>> ")
        child.sendline("/reset")
        child.expect_exact("[conversation cleared]")

        ids3, _ = turn("A fresh start.")
        assert ids3 == template_ids(tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "A fresh start."}])
        text3 = tokenizer.decode(ids3)
        assert SYSTEM in text3 and "Hello, who are you?" not in text3 and "Tell me more." not in text3

        child.expect_exact(">>> ")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, log.getvalue()[-3000:]
    assert "Traceback" not in log.getvalue()
    assert "<|im_end|>" not in log.getvalue().split("ready on cpu", 1)[1]


class _ScriptedLM:
    """Stands in for a causal LM: streams and returns a fixed continuation."""

    def __init__(self, continuation, max_positions=1024):
        self.continuation = continuation
        self.config = type("C", (), {"max_position_embeddings": max_positions})()
        self.generation_config = None
        self.calls = []

    def generate(self, input_ids, attention_mask, generation_config, streamer):
        self.calls.append((input_ids[0].tolist(), generation_config))
        new = torch.tensor([self.continuation[: generation_config.max_new_tokens]])
        streamer.put(input_ids)
        for t in new[0]:
            streamer.put(t.view(1))
        streamer.end()
        return torch.cat([input_ids, new], dim=1)


def test_reply_stops_at_eos_and_hides_it(tokenizer):
    hi = tokenizer.encode("Hi there!", add_special_tokens=False)
    lm = _ScriptedLM(hi + [tokenizer.eos_token_id])
    out = io.StringIO()
    session = ChatSession(lm, tokenizer, "cpu", ChatOptions(model="-", max_new_tokens=20, greedy=True), out)
    assert session.reply("hello") == "Hi there!"
    assert "Hi there!" in out.getvalue() and "<|im_end|>" not in out.getvalue() and "[stopped" not in out.getvalue()
    ids, gen = lm.calls[0]
    assert tokenizer.eos_token_id in gen.eos_token_id and gen.do_sample is False
    assert session.conv.turns == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi there!"}]

    lm.continuation = hi * 10  # no EOS within the budget: the user is told
    session.reply("again")
    assert "[stopped at --max_new_tokens 20]" in out.getvalue()


def test_sampling_flags_reach_generate(tokenizer):
    lm = _ScriptedLM([tokenizer.eos_token_id])
    opts = ChatOptions(model="-", temperature=0.5, top_p=0.8, top_k=7)
    ChatSession(lm, tokenizer, "cpu", opts, io.StringIO()).reply("x")
    gen = lm.calls[0][1]
    assert (gen.do_sample, gen.temperature, gen.top_p, gen.top_k) == (True, 0.5, 0.8, 7)


def test_context_full_drops_oldest_exchange(tokenizer):
    conv = Conversation(tokenizer)
    base = len(conv.prompt_ids("q"))
    lm = _ScriptedLM(tokenizer.encode(" word" * 30, add_special_tokens=False) + [tokenizer.eos_token_id],
                     max_positions=base + 60)
    out = io.StringIO()
    session = ChatSession(lm, tokenizer, "cpu", ChatOptions(model="-", max_new_tokens=40, greedy=True), out)
    for q in ("q", "q", "q"):
        session.reply(q)
    assert "dropped the 1 oldest exchange" in out.getvalue()
    assert all(len(ids) + 40 <= base + 60 for ids, _ in lm.calls)


def test_eof_ends_cleanly(tiny_dir, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n/help\n"))
    out = io.StringIO()
    run_chat(ChatOptions(model=str(tiny_dir), max_new_tokens=3, greedy=True, debug_ids=True), out)
    text = out.getvalue()
    assert text.count("[ids] ") == 1 and "/reset" in text and text.rstrip().endswith("bye")


def _fake_dir(tmp_path, tiny_dir, name, stage=None, weights="model.safetensors"):
    d = tmp_path / name
    d.mkdir()
    shutil.copy(tiny_dir / "config.json", d / "config.json")
    (d / weights).write_bytes(b"\0" * 16)
    if stage:
        (d / "rlhfkit.json").write_text(json.dumps({"format_version": 1, "stage": stage, "files": {}}))
    return d


@pytest.mark.parametrize("stage", ["reward", "critic"])
def test_reward_checkpoint_is_refused(tmp_path, tiny_dir, capsys, stage):
    d = _fake_dir(tmp_path, tiny_dir, "rm", stage=stage)
    with pytest.raises(SystemExit) as e:
        main(["chat", "--model", str(d)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"is a '{stage}' checkpoint" in err and "cannot chat" in err and "Traceback" not in err


def test_step3_dir_points_at_actor(tmp_path, capsys):
    (tmp_path / "step3" / "actor").mkdir(parents=True)
    (tmp_path / "step3" / "actor" / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        main(["chat", "--model", str(tmp_path / "step3")])
    assert "--model " + str(tmp_path / "step3" / "actor") in capsys.readouterr().err


def test_pickled_weights_and_remote_code_need_flags(tmp_path, tiny_dir, capsys):
    d = _fake_dir(tmp_path, tiny_dir, "pickled", weights="pytorch_model.bin")
    with pytest.raises(SystemExit):
        main(["chat", "--model", str(d)])
    assert "--allow_pickle_weights" in capsys.readouterr().err

    d = _fake_dir(tmp_path, tiny_dir, "remote")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoModelForCausalLM": "x.Y"}}))
    with pytest.raises(SystemExit):
        main(["chat", "--model", str(d)])
    assert "--trust_remote_code" in capsys.readouterr().err


def test_bad_sampling_flags(tiny_dir, capsys):
    with pytest.raises(SystemExit):
        main(["chat", "--model", str(tiny_dir), "--temperature", "0"])
    assert "--greedy" in capsys.readouterr().err
