"""Phase shares are deterministic, disjoint and covering; other containers (parquet, DeepSpeed-Chat
local/jsonfile directory, JSON lines named .json, gzip) read the same rows."""

import gzip
import json

import pytest

from rlhfkit.data import cut_eval, load_phase_data, parse_data_split, phase_rows
from rlhfkit.data.splits import cap_per_group
from rlhfkit.errors import ConfigError, DataError

N = 50
ROWS = [{"prompt": f"question {i}", "chosen": f"good {i}", "rejected": f"bad {i}", "id": i} for i in range(N)]


@pytest.fixture
def pairs_file(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return str(path)


def rows_of(examples):
    return [ex.meta["row"] for ex in examples]


def test_parse_data_split():
    assert parse_data_split("2,4,4") == [0.2, 0.4, 0.4]
    assert parse_data_split("10,0,0") == [1.0, 0.0, 0.0]
    assert parse_data_split("0, 0, 1") == [0.0, 0.0, 1.0]
    assert parse_data_split([1, 1, 2]) == [0.25, 0.25, 0.5]


def test_phase_rows_disjoint_and_covering():
    shares = [phase_rows(N, [0.2, 0.4, 0.4], p, seed=1234) for p in (1, 2, 3)]
    assert [len(s) for s in shares] == [10, 20, 20]  # round(0.2 * 50), round(0.6 * 50) - 10, rest
    assert sorted(shares[0] + shares[1] + shares[2]) == list(range(N))
    assert phase_rows(N, [0.2, 0.4, 0.4], 2, seed=1234) == shares[1]  # same seed, same rows
    assert phase_rows(N, [0.2, 0.4, 0.4], 2, seed=1235) != shares[1]


def test_rows_of_one_prompt_stay_together_in_shares_and_in_the_eval_cut(tmp_path):
    """AlpacaEval-style data: 4 answer pairs for each of 30 prompts. No prompt is in two steps' shares, and
    none is both trained on and held out within a step."""
    rows = [{"prompt": f"instruction {i // 4}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(120)]
    path = tmp_path / "grouped.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = []
    for phase, need in ((1, "sft"), (2, "pairs"), (3, "prompts")):
        train, evals, _ = load_phase_data(str(path), phase, need, eval_fraction=0.15)
        in_train = {ex.prompt[-1]["content"] for ex in train}
        in_eval = {ex.prompt[-1]["content"] for ex in evals}
        assert in_eval and not in_train & in_eval, (phase, in_train & in_eval)
        assert len(train + evals) == 4 * len(in_train | in_eval)  # whole groups only
        prompts.append(in_train | in_eval)
    assert [len(p) for p in prompts] == [6, 12, 12]  # 30 prompts cut 2,4,4
    assert not (prompts[0] & prompts[1]) and not (prompts[1] & prompts[2]) and not (prompts[0] & prompts[2])


def test_max_per_prompt_keeps_that_many_rows_of_each_prompt(tmp_path):
    """30 instructions x 4 pairs: --max_per_prompt 1 keeps one pair of each of the share's instructions, the
    same prompts as without the cap, held-out ones held out; the rows kept are a seeded draw, not the first."""
    rows = [{"prompt": f"instruction {i // 4}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(120)]
    rows += [{"prompt": "instruction 0", "chosen": "late good", "rejected": "late bad"}]  # a group not adjacent in the file
    path = tmp_path / "grouped.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = lambda exs: [ex.prompt[-1]["content"] for ex in exs]  # noqa: E731
    full_train, full_eval, _ = load_phase_data(str(path), 2, "pairs", eval_fraction=0.25)
    train, evals, [report] = load_phase_data(str(path), 2, "pairs", eval_fraction=0.25, max_per_prompt=1)
    assert set(prompts(train)) == set(prompts(full_train)) and set(prompts(evals)) == set(prompts(full_eval))
    assert len(prompts(train)) == len(set(prompts(train))) and len(prompts(evals)) == len(set(prompts(evals)))
    assert (report.kept, report.train_rows + report.eval_rows) == (12, 12)  # 30 prompts cut 2,4,4: 12 in phase 2
    assert report.over_cap == len(full_train + full_eval) - 12 and "dropped by --max_per_prompt 1" in report.summary()
    picked = [int(ex.chosen.split()[-1]) % 4 for ex in train + evals if ex.chosen != "late good"]
    assert len(set(picked)) > 1  # not always the first pair of a prompt
    two, _, [r2] = load_phase_data(str(path), 2, "pairs", eval_fraction=0.25, max_per_prompt=2)
    assert r2.kept == 24 and max(prompts(two).count(p) for p in prompts(two)) == 2
    assert load_phase_data(str(path), 2, "pairs", eval_fraction=0.25, max_per_prompt=1) == (train, evals, [report])
    with pytest.raises(ConfigError, match="--max_per_prompt must be at least 1"):
        load_phase_data(str(path), 2, "pairs", max_per_prompt=0)


def test_cap_per_group_by_hand():
    items, groups = list("abcdefg"), [0, 0, 1, 0, 1, 2, 1]
    kept = cap_per_group(items, groups, 1, seed=0)
    assert sorted(groups[items.index(x)] for x in kept) == [0, 1, 2]  # one of each group
    assert kept == sorted(kept, key=items.index)  # in the given order
    assert cap_per_group(items, groups, 3, seed=0) == items
    assert cap_per_group(items, groups, 2, seed=5) == cap_per_group(items, groups, 2, seed=5)
    assert len({tuple(cap_per_group(items, groups, 1, seed=s)) for s in range(20)}) > 1  # seeded, not fixed


def test_grouped_cut_by_hand():
    groups = [0, 0, 1, 1, 1, 2, 2, 3]
    # 0.5 * 8 = 4 falls inside group 1 (items 2-4): back to its start, 2 eval items
    assert cut_eval(list("abcdefgh"), 0.5, groups=groups) == (list("cdefgh"), list("ab"))
    # 1 item would split group 0; going back leaves none, so forward to its end
    assert cut_eval(list("abcdefgh"), 0.1, groups=groups) == (list("cdefgh"), list("ab"))
    assert phase_rows(6, [1, 0, 0], 1, seed=0, groups=[0, 1, 0, 2, 1, 2]) in (
        [0, 2, 1, 4, 3, 5], [0, 2, 3, 5, 1, 4], [1, 4, 0, 2, 3, 5], [1, 4, 3, 5, 0, 2], [3, 5, 0, 2, 1, 4], [3, 5, 1, 4, 0, 2])
    assert phase_rows(N, [0.2, 0.4, 0.4], 2, seed=1234, groups=list(range(N))) == phase_rows(N, [0.2, 0.4, 0.4], 2, seed=1234)


def test_load_same_seed_same_rows(pairs_file):
    a = load_phase_data(pairs_file, 1, "sft", seed=7)
    b = load_phase_data(pairs_file, 1, "sft", seed=7)
    assert a == b
    c = load_phase_data(pairs_file, 1, "sft", seed=8)
    assert set(rows_of(c[0] + c[1])) != set(rows_of(a[0] + a[1]))


def test_phases_disjoint_whatever_they_need(pairs_file):
    step1 = load_phase_data(pairs_file, 1, "sft")
    step2 = load_phase_data(pairs_file, 2, "pairs")
    step3 = load_phase_data(pairs_file, 3, "prompts")
    sets = [set(rows_of(train + evals)) for train, evals, _ in (step1, step2, step3)]
    assert [len(s) for s in sets] == [10, 20, 20]
    assert sets[0] | sets[1] | sets[2] == set(range(N))
    assert not (sets[0] & sets[1]) and not (sets[1] & sets[2]) and not (sets[0] & sets[2])
    # eval is cut from each share: 10% rounded, at least 1
    assert [len(s[1]) for s in (step1, step2, step3)] == [1, 2, 2]
    assert not set(rows_of(step2[0])) & set(rows_of(step2[1]))
    report = step2[2][0]
    assert (report.share_rows, report.kept, report.train_rows, report.eval_rows) == (20, 20, 18, 2)


def test_skipping_does_not_move_rows_between_phases(tmp_path, pairs_file):
    """Rows skipped in one step do not shift which rows the other steps get."""
    messy = [dict(r, rejected=r["chosen"]) if r["id"] % 3 == 0 else r for r in ROWS]  # chosen == rejected
    path = tmp_path / "messy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in messy))
    clean2 = load_phase_data(pairs_file, 2, "pairs")
    messy2 = load_phase_data(str(path), 2, "pairs")
    assert set(rows_of(messy2[0] + messy2[1])) == {i for i in rows_of(clean2[0] + clean2[1]) if i % 3}
    assert rows_of(sum(load_phase_data(str(path), 1, "sft")[:2], [])) == \
        rows_of(sum(load_phase_data(pairs_file, 1, "sft")[:2], []))


def test_cut_eval():
    assert cut_eval(list(range(10)), 0.1) == (list(range(1, 10)), [0])
    assert cut_eval([1, 2], 0.01) == ([2], [1])  # at least one eval row from two
    assert cut_eval([1], 0.5) == ([1], [])  # never the only row
    assert cut_eval(list(range(100)), 0.2, max_eval=5) == (list(range(5, 100)), list(range(5)))
    assert cut_eval(list(range(10)), 0.0) == (list(range(10)), [])


def test_parquet_reads_same_rows(tmp_path, pairs_file):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "pairs.data"  # detected by content, not extension
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    train, evals, [report] = load_phase_data(str(path), 2, "pairs")
    assert report.format == "prompt/chosen/rejected (parquet)" and report.rows == N
    ref = load_phase_data(pairs_file, 2, "pairs")
    assert [(e.prompt, e.chosen, e.rejected, e.meta["id"]) for e in train] == \
        [(e.prompt, e.chosen, e.rejected, e.meta["id"]) for e in ref[0]]


def test_gzip_and_json_list_and_jsonl_named_json(tmp_path, pairs_file):
    ref = load_phase_data(pairs_file, 1, "sft")[0]
    gz = tmp_path / "pairs.jsonl.gz"
    gz.write_bytes(gzip.compress(open(pairs_file, "rb").read()))
    as_list = tmp_path / "pairs.json"
    as_list.write_text(json.dumps(ROWS, indent=2))
    lines_named_json = tmp_path / "lines.json"
    lines_named_json.write_text(open(pairs_file).read())
    for path, container in ((gz, "jsonl.gz"), (as_list, "json"), (lines_named_json, "jsonl")):
        train, _, [report] = load_phase_data(str(path), 1, "sft")
        assert report.format == f"prompt/chosen/rejected ({container})"
        assert [(e.prompt, e.chosen) for e in train] == [(e.prompt, e.chosen) for e in ref]


def test_deepspeed_chat_local_jsonfile_dir(tmp_path):
    """DeepSpeed-Chat's local/jsonfile layout: DIR/data/train.json + eval.json, ' Human: ... Assistant:' prompts."""
    data = tmp_path / "chat" / "data"
    data.mkdir(parents=True)
    rows = [{"prompt": f" Human: q{i} Assistant:", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(6)]
    (data / "train.json").write_text(json.dumps(rows[:4]))
    (data / "eval.json").write_text(json.dumps(rows[4:]))
    train, evals, [report] = load_phase_data(str(tmp_path / "chat"), 1, "pairs", data_split="1,0,0",
                                             eval_fraction=0)
    assert report.format == "prompt/chosen/rejected (local/jsonfile)" and report.rows == 6
    by_row = {ex.meta["row"]: ex for ex in train}
    assert sorted(by_row) == list(range(6))  # train rows 0-3, then eval rows 4-5
    assert by_row[4].prompt == [{"role": "user", "content": "q4"}]
    assert (by_row[4].chosen, by_row[4].rejected) == ("yes 4", "no 4")
    # a bad row in eval.json is located in its file
    (data / "eval.json").write_text(json.dumps(rows[4:5] + [{"prompt": " Human: x Assistant:", "chosen": "",
                                                             "rejected": "r"}]))
    from rlhfkit.errors import DataError

    with pytest.raises(DataError, match=r"row 5 \(eval.json list item 1\): empty response"):
        load_phase_data(str(tmp_path / "chat"), 1, "pairs", data_split="1,0,0", strict=True)


def test_tsv_with_header_and_json_list_of_strings(tmp_path):
    tsv = tmp_path / "sft.tsv"
    tsv.write_text("prompt\tresponse\nhello\thi there\nbye\tsee you\n")
    train, _, [report] = load_phase_data(str(tsv), 1, "sft", data_split="1,0,0", eval_fraction=0)
    assert report.format == "prompt/response (tsv)"
    assert sorted((e.prompt[0]["content"], e.chosen) for e in train) == [("bye", "see you"), ("hello", "hi there")]
    strings = tmp_path / "prompts.json"
    strings.write_text(json.dumps(["first prompt", "second prompt"]))
    train, _, [report] = load_phase_data(str(strings), 3, "prompts", data_split="0,0,1", eval_fraction=0)
    assert report.format == "strings (json)"
    assert sorted(e.prompt[0]["content"] for e in train) == ["first prompt", "second prompt"]


def test_prompts_of_an_earlier_source_are_dropped_before_the_split(tmp_path, pairs_file):
    """MGSM's English problems are GSM8K's first 250: a prompt in two --data_path files is read once, from the
    first, so it can never be trained on from one file and held out from the other."""
    later = [dict(r, chosen=f"other {r['id']}") for r in ROWS[:20]]  # 20 prompts of pairs_file, other answers
    later += [{"prompt": f"new question {i}", "chosen": "a", "rejected": "b"} for i in range(30)]
    path = tmp_path / "later.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in later))

    train, evals, reports = load_phase_data([pairs_file, str(path)], 3, "prompts", data_split="0,0,1", eval_fraction=0.2)
    first, second = reports
    assert (first.duplicates, first.kept) == (0, 50)
    assert (second.duplicates, second.share_rows, second.kept) == (20, 30, 30)
    assert "20 rows dropped before the split" in second.summary()
    prompts = [ex.prompt[-1]["content"] for ex in train + evals]
    assert len(prompts) == len(set(prompts)) == 80
    # the later source is split as if it held only its 30 new rows; the first source is unchanged
    alone = tmp_path / "alone.jsonl"
    alone.write_text("".join(json.dumps(r) + "\n" for r in later[20:]))
    t2, e2, _ = load_phase_data(str(alone), 3, "prompts", data_split="0,0,1", eval_fraction=0.2)
    assert [ex.prompt for ex in evals[-len(e2):]] == [ex.prompt for ex in e2]
    assert load_phase_data(pairs_file, 3, "prompts", data_split="0,0,1", eval_fraction=0.2)[1] == evals[:len(evals) - len(e2)]


def test_a_source_of_only_duplicate_prompts_is_an_error(pairs_file):
    with pytest.raises(DataError, match="every prompt of its 50 rows is already in an earlier --data_path"):
        load_phase_data([pairs_file, pairs_file], 3, "prompts")


def test_held_out_prompts_are_recreated_with_the_runs_max_per_prompt(tmp_path):
    """`rlhfkit eval` re-creates step 3's held-out prompts from the actor's manifest, --max_per_prompt included:
    the same prompts step 3 held out, one row each."""
    from rlhfkit.eval_prompts import held_out_prompt_rows

    rows = [{"prompt": f"instruction {i // 4}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(120)]
    path = tmp_path / "grouped.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"data_path": [str(path)], "data_split": "0,0,1", "seed": 3, "eval_fraction": 0.2, "max_eval_samples": None,
              "max_per_prompt": 1}
    got, _, _ = held_out_prompt_rows("actor", {"stage": "actor", "config": config}, 64)
    _, step3_eval, _ = load_phase_data(str(path), 3, "prompts", data_split="0,0,1", seed=3, eval_fraction=0.2, max_per_prompt=1)
    assert got == step3_eval and len(got) == 6  # 20% of 30 prompts, once each
