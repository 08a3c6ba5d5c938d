"""Several weighted rule rewards (--reward_fn NAME[:WEIGHT], repeated): parsing, the weighted sum and each
component's metrics by hand, per-component normalisation, and clear errors for NaN and duplicates."""

import math

import pytest
import torch

from rlhfkit.errors import ConfigError, RlhfkitError
from rlhfkit.rewards import RewardFunctions, parse_reward_spec, call_reward_fn


def length_reward(prompts, responses, rows):
    return [float(len(r)) for r in responses]


def half_nan(prompts, responses, rows):
    return [1.0, math.inf][: len(responses)]


def test_parse_reward_spec():
    assert parse_reward_spec("gsm8k", 1.0) == ("gsm8k", 1.0)
    assert parse_reward_spec("gsm8k:0.5", 1.0) == ("gsm8k", 0.5)
    assert parse_reward_spec("pkg.mod:fn", 0.3) == ("pkg.mod:fn", 0.3)  # today's module:function keeps working
    assert parse_reward_spec("pkg.mod:fn:-2", 1.0) == ("pkg.mod:fn", -2.0)
    assert parse_reward_spec("pkg.mod:fn:1e-1", 1.0) == ("pkg.mod:fn", 0.1)


def test_weighted_sum_and_parts_by_hand():
    fns = RewardFunctions.load(["gsm8k:2", "test_reward_components:length_reward:0.5"])
    rows = [{"answer": "#### 4"}, {"answer": "#### 5"}]
    responses = ["#### 4", "it is 6"]  # gsm8k: correct + formatted, wrong; lengths 6 and 7
    parts = {}
    total = fns.score(["q", "q"], responses, rows, parts, "cpu", lambda t: t, gsm8k_kwargs={"format_bonus": 0.5})
    # gsm8k: 1 + 0.5 (format) = 1.5 and 0; weight 2 -> 3, 0. length: 6, 7, weight 0.5 -> 3, 3.5
    torch.testing.assert_close(total, torch.tensor([6.0, 3.5]))
    assert parts["fn/gsm8k"] == [1.5, 0.0] and parts["fn/gsm8k/weighted"] == [3.0, 0.0]
    assert parts["fn/test_reward_components:length_reward"] == [6.0, 7.0]
    assert parts["fn/test_reward_components:length_reward/weighted"] == [3.0, 3.5]
    assert parts["gsm8k_accuracy"] == [1.0, 0.0] and parts["gsm8k_format"] == [1.0, 0.0]


def test_per_component_normalisation_uses_training_batches_only():
    fns = RewardFunctions.load(["test_reward_components:length_reward:2"], normalize=True)
    parts = {}
    # first batch lengths 1, 3: mean 2, var 1 -> normalised -1, +1, weighted -2, +2
    out = fns.score(["q"] * 2, ["a", "abc"], [{}, {}], parts, "cpu", lambda t: t)
    torch.testing.assert_close(out, torch.tensor([-2.0, 2.0]), rtol=0, atol=1e-6)
    state = fns.state_dict()
    # an evaluation batch reads the moments and leaves them as they were
    out = fns.score(["q"], ["abcde"], [{}], parts, "cpu", lambda t: t, training=False)
    torch.testing.assert_close(out, torch.tensor([2.0 * (5 - 2) / 1.0]), rtol=0, atol=1e-6)
    assert fns.state_dict() == state
    # the next training batch (5, 5) updates them: 4 values 1, 3, 5, 5 -> mean 3.5, var 2.75
    fns.score(["q"] * 2, ["abcde"] * 2, [{}, {}], parts, "cpu", lambda t: t)
    (name, moments), = fns.state_dict().items()
    assert moments == pytest.approx({"count": 4.0, "mean": 3.5, "var": 2.75})
    again = RewardFunctions.load(["test_reward_components:length_reward:2"], normalize=True)
    again.load_state_dict(fns.state_dict())
    assert again.state_dict() == fns.state_dict()


def test_errors_name_the_component():
    with pytest.raises(ConfigError, match="names a source twice"):
        RewardFunctions.load(["gsm8k:1", "gsm8k:2"])
    with pytest.raises(RlhfkitError, match=r"reward function x returned inf for sample 1 \(prompt 'q', response 'b'\)"):
        call_reward_fn("x", half_nan, ["q", "q"], ["a", "b"], [{}, {}])
