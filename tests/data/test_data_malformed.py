"""Malformed rows are skipped and counted (or fail under strict); bad sources fail with one clear
DataError. Every fixture is written here into tmp_path."""

import gzip
import json

import pytest

from rlhfkit.data import load_phase_data
from rlhfkit.errors import DataError

ALL = dict(phase=1, data_split="1,0,0", eval_fraction=0)  # the whole file in phase 1's train list


def write_jsonl(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    return path


GOOD = {"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"}
MESSY = [
    GOOD,                                                     # row 0
    '{"prompt": "broken", "chosen": ',                         # row 1: bad JSON line
    {"prompt": "p", "chosen": "c"},                           # row 2: missing rejected
    {"prompt": "p", "chosen": "   ", "rejected": "r"},        # row 3: empty response
    {"prompt": "p", "chosen": "same", "rejected": "same"},    # row 4: chosen == rejected
    {"prompt": "p", "chosen": 7, "rejected": "r"},            # row 5: wrong type
    {"prompt": "", "chosen": "c", "rejected": "r"},           # row 6: empty prompt
    ["not", "an", "object"],                                  # row 7: row is not an object
    {"prompt": [{"role": "user", "content": "hi"}], "chosen": "hello", "rejected": "go away"},  # row 8
]


def test_pairs_skips_counted_with_first_rows(tmp_path):
    path = write_jsonl(tmp_path / "messy.jsonl", MESSY)
    train, _, [report] = load_phase_data(str(path), need="pairs", **ALL)
    assert sorted(ex.meta["row"] for ex in train) == [0, 8]
    assert report.rows == 9 and report.kept == 2 and report.share_rows == 9
    assert report.skipped == {
        "bad JSON line": 1, "missing field 'rejected'": 1, "empty response": 1, "chosen == rejected": 1,
        "wrong type for 'chosen'": 1, "empty prompt": 1, "wrong type": 1,
    }
    assert report.first_skips == [(1, "bad JSON line"), (2, "missing field 'rejected'"), (3, "empty response"),
                                  (4, "chosen == rejected"), (5, "wrong type for 'chosen'")]
    assert "skipped 7" in report.summary() and "1 (bad JSON line)" in report.summary()
    by_row = {ex.meta["row"]: ex for ex in train}
    assert by_row[8].prompt == [{"role": "user", "content": "hi"}]
    assert (by_row[8].chosen, by_row[8].rejected) == ("hello", "go away")


def test_sft_keeps_rows_without_rejected(tmp_path):
    path = write_jsonl(tmp_path / "messy.jsonl", MESSY)
    train, _, [report] = load_phase_data(str(path), need="sft", **ALL)
    # rows 2 (no rejected) and 4 (chosen == rejected) are fine for SFT
    assert sorted(ex.meta["row"] for ex in train) == [0, 2, 4, 8]
    assert report.skipped == {"bad JSON line": 1, "empty response": 1, "wrong type for 'chosen'": 1,
                              "empty prompt": 1, "wrong type": 1}


@pytest.mark.parametrize("bad_row, message", [
    ('{"prompt": "x", "chosen": ', r"row 1 \(line 2\): bad JSON line \(Expecting value at column 27\)"),
    ({"prompt": "p", "chosen": "c"}, r"row 1 \(line 2\): missing field 'rejected'"),
    ({"prompt": "p", "chosen": "", "rejected": "r"}, r"row 1 \(line 2\): empty response"),
    ({"prompt": "p", "chosen": "x", "rejected": "x"}, r"row 1 \(line 2\): chosen == rejected"),
    ({"prompt": "p", "chosen": ["x"], "rejected": "r"}, r"row 1 \(line 2\): wrong type for 'chosen'"),
])
def test_strict_raises_naming_file_and_row(tmp_path, bad_row, message):
    path = write_jsonl(tmp_path / "one_bad.jsonl", [GOOD, bad_row, GOOD])
    with pytest.raises(DataError, match=message) as e:
        load_phase_data(str(path), need="pairs", strict=True, **ALL)
    assert str(path) in str(e.value) and "without --strict" in str(e.value)
    load_phase_data(str(path), need="pairs", **ALL)  # not strict: skipped, no error


def test_hh_rlhf_malformed(tmp_path):
    dialogue = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how are you?\n\nAssistant: "
    path = write_jsonl(tmp_path / "hh.jsonl", [
        {"chosen": dialogue + "fine", "rejected": dialogue + "go away"},                    # good
        {"chosen": dialogue + "fine", "rejected": "\n\nHuman: other\n\nAssistant: no"},     # differ
        {"chosen": "no dialogue here", "rejected": "nor here"},                             # not a dialogue
        {"chosen": dialogue + "same", "rejected": dialogue + " same "},                     # equal after strip
        {"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: a\n\nAssistant:"},  # empty rejected
    ])
    train, _, [report] = load_phase_data(str(path), need="pairs", **ALL)
    assert [ex.meta["row"] for ex in train] == [0]
    assert train[0].prompt == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                               {"role": "user", "content": "how are you?"}]
    assert (train[0].chosen, train[0].rejected) == ("fine", "go away")
    assert report.skipped == {"chosen and rejected differ before the last assistant turn": 1,
                              "not an hh-rlhf dialogue": 1, "chosen == rejected": 1, "empty response": 1}


def test_unknown_format_names_fields(tmp_path):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"text": "a", "label": 1}])
    with pytest.raises(DataError, match=r"odd.jsonl: unknown data format \(jsonl\); fields found: label, text\.") as e:
        load_phase_data(str(path), 1, "sft")
    assert "prompt/chosen/rejected" in str(e.value) and "hh-rlhf" in str(e.value)  # formats listed


def test_unknown_file_content(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("prompt,chosen\nhi,hello\n")
    with pytest.raises(DataError, match=r"data.csv: unknown file format .*starts with 'prompt,chosen'"):
        load_phase_data(str(path), 1, "sft")


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=r"data file not found: .*nope.jsonl"):
        load_phase_data(str(path), 1, "sft")


def test_missing_relative_file_is_not_taken_for_a_hub_name():
    with pytest.raises(DataError, match=r"data file not found: data/train.jsonl"):
        load_phase_data("data/train.jsonl", 1, "sft")


def test_zero_usable_rows(tmp_path):
    path = write_jsonl(tmp_path / "empty_answers.jsonl", [{"prompt": "p", "response": ""}] * 3)
    with pytest.raises(DataError, match=r"empty_answers.jsonl has no usable rows for step 1 \(SFT\) \(need sft\): "
                                        r"all 3 rows of its share were skipped 3: empty response 3; first rows: 0 \(empty response\)"):
        load_phase_data(str(path), need="sft", **ALL)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(DataError, match="empty.jsonl: the file is empty"):
        load_phase_data(str(path), 1, "sft")


def test_phase_with_zero_share(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [GOOD] * 10)
    with pytest.raises(DataError, match=r"--data_split 10,0,0 gives step 2 \(reward model\) no share of the data.*"
                                        r"--data_split 0,10,0"):
        load_phase_data(str(path), 2, "pairs", data_split="10,0,0")


def test_phase_share_rounds_to_zero(tmp_path):
    path = write_jsonl(tmp_path / "tiny.jsonl", [GOOD] * 2)
    with pytest.raises(DataError, match=r"--data_split 2,4,4 leaves step 1 \(SFT\) no rows of .*tiny.jsonl: its share "
                                        r"\(20%\) of 2 rows rounds to 0.*--data_split 10,0,0"):
        load_phase_data(str(path), 1, "sft", data_split="2,4,4")


@pytest.mark.parametrize("split", ["2,4", "a,b,c", "1,-1,1", "0,0,0", ""])
def test_malformed_data_split(tmp_path, split):
    path = write_jsonl(tmp_path / "a.jsonl", [GOOD] * 10)
    with pytest.raises(DataError, match=r"--data_split .* is malformed: expected three non-negative numbers"):
        load_phase_data(str(path), 1, "sft", data_split=split)


def test_corrupt_gzip(tmp_path):
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(gzip.compress(json.dumps(GOOD).encode() * 100)[:40])
    with pytest.raises(DataError, match="cut.jsonl.gz: looks gzip-compressed but cannot be decompressed"):
        load_phase_data(str(path), 1, "sft")


def test_invalid_json_list(tmp_path):
    path = tmp_path / "list.json"
    path.write_text('[{"prompt": "a", "response": "b"},\n {"prompt": ]')
    with pytest.raises(DataError, match=r"list.json: not valid JSON \(line 2, column 13"):
        load_phase_data(str(path), 1, "sft")


def test_hub_name_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError) as e:
        load_phase_data("Dahoas/rm-static", 1, "sft")
    msg = str(e.value)
    assert "could not fetch the hub dataset 'Dahoas/rm-static' (offline mode: HF_HUB_OFFLINE=1)" in msg
    assert "--data_path /path/to/file.jsonl" in msg and "JSON lines (.jsonl" in msg
