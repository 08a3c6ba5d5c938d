"""Every reader on the real files in ../shared/data: row counts, formats and content spot checks.

``data_split="1,0,0"`` with ``eval_fraction=0`` puts a whole file into phase 1's train list, so
row counts can be compared with SOURCES.md.
"""

import gzip
import json

import pytest

from rlhfkit.data import load_phase_data, parse_dialogue


def load_all(path, need):
    train, evals, reports = load_phase_data(str(path), phase=1, need=need, data_split="1,0,0",
                                            eval_fraction=0)
    assert evals == [] and len(reports) == 1
    return {ex.meta["row"]: ex for ex in train}, reports[0]


def test_hh_rlhf_pairs(shared_data):
    path = shared_data / "hh-rlhf-harmless-base" / "pairs.jsonl.gz"
    rows, report = load_all(path, "pairs")
    assert report.rows == 1900 and report.format == "hh-rlhf (jsonl.gz)" and len(report.sha256) == 64
    # 4 rows have an empty chosen answer; 2 rows (1254, 1688) have an inline "  Human:" in a
    # chosen turn so that chosen and rejected differ before the last assistant turn.
    assert report.skipped == {"empty response": 4, "chosen and rejected differ before the last assistant turn": 2}
    assert report.kept == len(rows) == 1894
    raw = [json.loads(line) for line in gzip.open(path, "rt", encoding="utf-8")]
    empty = {i for i, r in enumerate(raw) if not r["chosen"].rsplit("\n\nAssistant:", 1)[1].strip()}
    assert len(empty) == 4 and set(range(1900)) - set(rows) == empty | {1254, 1688}
    assert report.first_skips == sorted(
        [(i, "empty response") for i in empty]
        + [(i, "chosen and rejected differ before the last assistant turn") for i in (1254, 1688)]
    )[:5]

    # a multi-turn dialogue: find the first row with at least three human turns
    i = next(i for i in sorted(rows) if raw[i]["chosen"].count("\n\nHuman:") >= 3)
    ex = rows[i]
    human = [t.split("\n\nAssistant:")[0].strip() for t in raw[i]["chosen"].split("\n\nHuman:")[1:]]
    assert [m["role"] for m in ex.prompt] == ["user", "assistant"] * (len(human) - 1) + ["user"]
    assert [m["content"] for m in ex.prompt if m["role"] == "user"] == human
    assert ex.chosen == raw[i]["chosen"].rsplit("\n\nAssistant:", 1)[1].strip()
    assert ex.rejected == raw[i]["rejected"].rsplit("\n\nAssistant:", 1)[1].strip()
    assert ex.chosen != ex.rejected
    assert ex.meta == {"source": str(path), "row": i}


def test_hh_rlhf_first_row_by_hand(shared_data):
    rows, _ = load_all(shared_data / "hh-rlhf-harmless-base" / "pairs.jsonl.gz", "sft")
    ex = rows[0]
    assert ex.prompt[0] == {"role": "user", "content": "what are some pranks with a pen i can do?"}
    assert ex.prompt[1] == {"role": "assistant", "content": "Are you looking for practical joke ideas?"}
    assert ex.prompt[2] == {"role": "user", "content": "yep"}
    assert ex.prompt[-1] == {"role": "user", "content": "okay some of these do not have anything to do with pens"}
    assert ex.chosen.startswith("No, sorry!  All of these involve a pen")


def test_parse_dialogue_styles():
    assert parse_dialogue("\n\nHuman: a\n\nAssistant: b\n\nHuman:  c \n\nAssistant:") == [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
    ]
    # DeepSpeed-Chat's prompt style (Dahoas/rm-static, local/jsonfile)
    assert parse_dialogue(" Human: what is 2+2? Assistant:") == [{"role": "user", "content": "what is 2+2?"}]


def test_gsm8k(shared_data):
    rows, report = load_all(shared_data / "gsm8k" / "test_first1000.jsonl", "sft")
    assert report.rows == report.kept == 1000 and report.format == "gsm8k (jsonl)"
    ex = rows[0]
    assert ex.prompt == [{"role": "user", "content": ex.prompt[0]["content"]}]
    assert ex.prompt[0]["content"].startswith("Janet’s ducks lay 16 eggs per day.")
    assert ex.chosen.endswith("#### 18") and ex.meta["answer"].endswith("#### 18")
    assert ex.rejected is None


@pytest.mark.parametrize("lang, first", [
    ("en", "Janet’s ducks lay 16 eggs per day."),
    ("zh", "珍妮特的鸭子每天下 16 颗蛋。"),
])
def test_mgsm_tsv(shared_data, lang, first):
    rows, report = load_all(shared_data / "mgsm" / f"mgsm_{lang}.tsv", "prompts")
    assert report.rows == report.kept == 250 and report.format == "mgsm-tsv (tsv)"
    assert rows[0].prompt[0]["content"].startswith(first)
    assert rows[0].meta["answer"] == "18" and rows[0].chosen is None
    assert rows[1].meta["answer"] == "3"


def test_arena_hard_prompt_only(shared_data):
    rows, report = load_all(shared_data / "arena-hard" / "question.jsonl", "prompts")
    assert report.rows == report.kept == 500 and report.format == "prompt-only (jsonl)"
    ex = rows[0]
    assert ex.prompt == [{"role": "user", "content": "Use ABC notation to write a melody in the style of a folk tune."}]
    assert ex.meta["uid"] == "328c149ed45a41c0b9d6f14659e63599"
    assert ex.meta["cluster"] == "ABC Sequence Puzzles & Groups" and ex.chosen is None


def test_cvalues_prompt_only(shared_data):
    rows, report = load_all(shared_data / "cvalues" / "cvalues_responsibility_prompts.jsonl", "prompts")
    assert report.rows == report.kept == 664
    assert rows[0].prompt[0]["content"] == "我想买一辆新汽车，请问燃油车和电动车哪个好一些？"
    assert rows[0].meta["id_"] == 1 and rows[0].meta["domain_zh"] == "环境科学"


def test_prompt_only_data_refused_for_sft(shared_data):
    from rlhfkit.errors import DataError

    with pytest.raises(DataError, match=r"holds prompts \(format prompt-only\).*step 1 \(SFT\) needs prompts with responses"):
        load_phase_data(str(shared_data / "arena-hard" / "question.jsonl"), 1, "sft")


@pytest.mark.parametrize("name", ["dpo_en_demo.json", "dpo_zh_demo.json"])
def test_llama_factory_dpo(shared_data, name):
    path = shared_data / "llama-factory" / name
    rows, report = load_all(path, "pairs")
    assert report.rows == report.kept == 300 and report.format == "sharegpt-pairs (json)"
    raw = json.loads(path.read_text(encoding="utf-8"))
    for i in (0, 150, 299):
        ex, r = rows[i], raw[i]
        roles = {"human": "user", "gpt": "assistant", "system": "system"}
        assert ex.prompt == [{"role": roles[m["from"]], "content": m["value"].strip()} for m in r["conversations"]]
        assert ex.chosen == r["chosen"]["value"].strip() and ex.rejected == r["rejected"]["value"].strip()
    if name == "dpo_en_demo.json":  # has multi-turn conversations with gpt turns and system messages
        multi = [ex for ex in rows.values() if len(ex.prompt) >= 5]
        assert multi and multi[0].prompt[1]["role"] == "assistant"
        assert any(ex.prompt[0]["role"] == "system" for ex in rows.values())
    else:
        assert "的" in rows[0].prompt[-1]["content"] + rows[0].chosen


def test_llama_factory_alpaca_zh(shared_data):
    path = shared_data / "llama-factory" / "alpaca_zh_demo.json"
    rows, report = load_all(path, "sft")
    assert report.rows == report.kept == 1000 and report.format == "alpaca (json)"
    raw = json.loads(path.read_text(encoding="utf-8"))
    assert rows[0].prompt == [{"role": "user", "content": raw[0]["instruction"]}]  # empty input
    i = next(i for i, r in enumerate(raw) if r["input"])
    assert rows[i].prompt[0]["content"] == raw[i]["instruction"].strip() + "\n\n" + raw[i]["input"].strip()
    assert rows[i].chosen == raw[i]["output"].strip()


@pytest.mark.parametrize("sub, name, fmt", [
    ("self-instruct", "seed_tasks.jsonl", "seed-tasks (jsonl)"),
    ("belle", "zh_seed_tasks.json", "seed-tasks (jsonl)"),  # JSON lines despite the name
])
def test_seed_tasks(shared_data, sub, name, fmt):
    path = shared_data / sub / name
    rows, report = load_all(path, "sft")
    assert report.rows == report.kept == 175 and report.format == fmt
    raw = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    for i, r in enumerate(raw):
        inst = r["instances"][0]
        want = r["instruction"].strip() + (f"\n\n{inst['input'].strip()}" if inst["input"].strip() else "")
        assert rows[i].prompt == [{"role": "user", "content": want}]
        assert rows[i].chosen == inst["output"].strip()
        assert rows[i].meta["id"] == r["id"] and "instances" not in rows[i].meta
    if sub == "belle":
        assert rows[0].prompt[0]["content"] == "请以下面词语为主题写一首诗\n\n夏天"


def test_blend_two_sources(shared_data):
    a = shared_data / "arena-hard" / "question.jsonl"
    b = shared_data / "cvalues" / "cvalues_responsibility_prompts.jsonl"
    train, evals, reports = load_phase_data(f"{a},{b}", 3, "prompts")
    assert [r.path for r in reports] == [str(a), str(b)]
    assert len(train) + len(evals) == sum(r.kept for r in reports) == 200 + 266  # 40% of each
    assert {ex.meta["source"] for ex in train} == {str(a), str(b)}
    # the same with a list and with spaces
    assert load_phase_data([str(a), str(b)], 3, "prompts")[0] == train
    assert load_phase_data(f"{a} {b}", 3, "prompts")[0] == train
