"""The seeded arithmetic word problems: right answers, GSM8K rows the gsm8k reward grades, reproducible."""

import json
import re

import pytest

from rlhfkit.data import load_phase_data
from rlhfkit.data.arithmetic import make_problems, write_problems
from rlhfkit.rewards import gsm8k_reward


def test_every_worked_step_and_answer_is_right():
    """Each step 'a op b = c' recomputed by hand, the last step's result is the '#### n' answer, and the question
    holds the operands the steps use (a two-step problem's second step starts from the first's result)."""
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}
    for row in make_problems(600, seed=3):
        *steps, final = row["answer"].split("\n")
        results = []
        for step in steps:
            a, op, b, c = re.fullmatch(r"(\d+) ([-+*/]) (\d+) = (\d+)", step).groups()
            assert ops[op](int(a), int(b)) == int(c), step
            question_numbers = re.findall(r"\d+", row["question"])
            assert b in question_numbers and (a in question_numbers or a in results), (row, step)
            results.append(c)
        assert final == f"#### {results[-1]}" and int(results[-1]) >= 0
    assert {"+", "-", "*", "/"} <= {s.split()[1] for r in make_problems(200) for s in r["answer"].split("\n")[:-1]}
    assert {1, 2} == {len(r["answer"].split("\n")) - 1 for r in make_problems(200)}


def test_hand_checked_examples():
    rows = make_problems(3, seed=0)
    assert rows[0] == {"question": "Noah shares 60 apples equally among 6 friends. How many apples does each friend get?",
                       "answer": "60 / 6 = 10\n#### 10"}
    assert rows[2]["question"] == "Tara has 5 bags. Each of them holds 10 eggs. How many eggs does Tara have in all?"
    assert rows[2]["answer"] == "5 * 10 = 50\n#### 50"


def test_same_seed_same_rows_distinct_questions(tmp_path):
    assert make_problems(300, seed=1) == make_problems(300, seed=1)
    assert make_problems(300, seed=1) != make_problems(300, seed=2)
    assert len({r["question"] for r in make_problems(2000)}) == 2000
    with pytest.raises(ValueError, match="n must be >= 1"):
        make_problems(0)
    path = write_problems(tmp_path / "sub" / "arith.jsonl", 50, seed=4)
    assert [json.loads(line) for line in path.read_text().splitlines()] == make_problems(50, seed=4)


def test_read_as_gsm8k_and_graded_by_the_gsm8k_reward(tmp_path):
    path = write_problems(tmp_path / "arith.jsonl", 40)
    train, evals, reports = load_phase_data(str(path), 3, "prompts", data_split="0,0,1")
    assert reports[0].format.startswith("gsm8k") and len(train) + len(evals) == 40
    rows = [ex.meta for ex in train[:3]]
    gold = [r["answer"].split("#### ")[1] for r in rows]
    responses = [f"So the answer is\n#### {gold[0]}", f"It is {int(gold[1]) + 1}.", f"#### {gold[2]}"]
    assert gsm8k_reward(["q"] * 3, responses, rows, format_bonus=0.5) == [1.5, 0.0, 1.5]


EASY_SEED0 = {"question": "Noah shares 20 apples equally among 4 friends. How many apples does each friend get?",
              "answer": "20 / 4 = 5\n#### 5"}  # 20 / 4 = 5, by hand


def test_easy_level_is_one_operation_on_numbers_up_to_20():
    rows = make_problems(400, seed=5, level="easy")
    assert {len(r["answer"].split("\n")) for r in rows} == {2}  # one worked step, then '#### n'
    ops = {r["answer"].split()[1] for r in rows}
    assert ops == {"+", "-", "*", "/"}
    for r in rows:
        a, op, b = r["answer"].split()[:3]
        assert max(int(a), int(b)) <= (25 if op == "/" else 20), r  # a dividend is a product of two numbers up to 5
    assert make_problems(1, seed=0, level="easy") == [EASY_SEED0]
    assert make_problems(50, seed=1) == make_problems(50, seed=1, level="mixed")  # the default level is unchanged
    with pytest.raises(ValueError, match="level must be one of"):
        make_problems(3, level="hard")
