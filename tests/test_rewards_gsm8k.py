"""The built-in gsm8k reward on real GSM8K and MGSM rows from ../shared/data, read through the data
layer as step 3 reads them (``Example.meta`` is the row the reward function gets)."""

import pytest

from rlhfkit.data import load_phase_data
from rlhfkit.rewards.rules import extract_answer, gsm8k_parts, gsm8k_reward, load_reward_fn, reference_answer


def rows_of(path, need):
    train, _, _ = load_phase_data(str(path), phase=1, need=need, data_split="1,0,0", eval_fraction=0)
    return {ex.meta["row"]: ex.meta for ex in train}


@pytest.fixture(scope="module")
def gsm8k(shared_data):
    return rows_of(shared_data / "gsm8k" / "test_first1000.jsonl", "prompts")


@pytest.fixture(scope="module")
def mgsm_zh(shared_data):
    return rows_of(shared_data / "mgsm" / "mgsm_zh.tsv", "prompts")


@pytest.fixture(scope="module")
def mgsm_en(shared_data):
    return rows_of(shared_data / "mgsm" / "mgsm_en.tsv", "prompts")


def test_gold_answers_of_real_rows(gsm8k, mgsm_en, mgsm_zh):
    assert gsm8k[0]["answer"].endswith("#### 18") and reference_answer(gsm8k[0]) == 18
    # every GSM8K row has a parsable gold number, thousands separators included ("#### 2,125")
    golds = {i: reference_answer(r) for i, r in gsm8k.items()}
    assert None not in golds.values()
    comma_rows = [i for i, r in gsm8k.items() if "," in r["answer"].rsplit("####", 1)[1]]
    assert len(comma_rows) == 12 and all(golds[i] == float(gsm8k[i]["answer"].rsplit("####", 1)[1].replace(",", ""))
                                         for i in comma_rows)
    # MGSM: the answer column is a bare number, in the English and the Chinese file alike
    assert reference_answer(mgsm_en[0]) == reference_answer(mgsm_zh[0]) == 18
    assert reference_answer(mgsm_zh[2]) == 70000 and mgsm_zh[2]["answer"] == "70000"
    assert all(reference_answer(r) is not None for r in mgsm_zh.values())


def test_correct_wrong_unparsable_on_gsm8k(gsm8k):
    row = gsm8k[0]  # Janet's ducks: 18
    responses = [
        row["answer"],                                              # the reference solution itself
        "She has 16 - 3 - 4 = 9 eggs and earns 9 * 2 = 18 dollars.",  # last number
        "So the answer is \\boxed{18}.",                            # boxed
        "#### $18",                                                 # dollar sign after ####
        "The answer is 18. Step check: 9 eggs at $2.",              # last number is 2: wrong
        "#### 17",                                                  # wrong
        "I do not know.",                                           # unparsable
        "",                                                         # empty
    ]
    scores = gsm8k_reward(["q"] * len(responses), responses, [row] * len(responses))
    assert scores == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    # the format bonus only for '#### n' / '\boxed{}' answers
    bonus = gsm8k_reward(["q"] * 3, [responses[0], responses[1], responses[5]], [row] * 3, format_bonus=0.1)
    assert bonus == [1.1, 1.0, 0.1]
    # the two parts step 3 reports as reward/gsm8k_accuracy and reward/gsm8k_format
    assert gsm8k_parts(responses, [row] * len(responses)) == ([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0],
                                                              [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0])


def test_thousands_separator_rows(gsm8k):
    i = next(i for i, r in gsm8k.items() if "#### 2,125" in r["answer"])
    row = gsm8k[i]
    assert gsm8k_reward(["q"] * 3, ["#### 2,125", "The total is 2125.", "#### 2,126"], [row] * 3) == [1.0, 1.0, 0.0]


def test_mgsm_zh_chinese_numerals_are_left_as_they_are(mgsm_zh):
    """Chinese-numeral answers are not converted: '十八' is no number to the reward (0), while the
    same answer in Arabic digits inside Chinese text scores 1."""
    row = mgsm_zh[0]  # 18
    responses = ["她每天在农贸市场赚 18 美元。", "答案：\\boxed{18}", "她每天赚十八美元。", "她每天赚 16 美元。"]
    assert gsm8k_reward(["q"] * 4, responses, [row] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert extract_answer("她每天赚十八美元。") is None


def test_mgsm_en_and_builtin_name(mgsm_en):
    fn = load_reward_fn("gsm8k")
    row = mgsm_en[1]  # 3 bolts
    assert fn(["q"] * 2, ["It takes 2 + 1 = 3 bolts.", "It takes 2 bolts."], [row] * 2) == [1.0, 0.0]


def test_rows_without_answer_get_a_clear_error():
    from rlhfkit.errors import RlhfkitError

    with pytest.raises(RlhfkitError, match="needs an 'answer' field"):
        gsm8k_reward(["q"], ["18"], [{"source": "x.jsonl", "row": 0}])
