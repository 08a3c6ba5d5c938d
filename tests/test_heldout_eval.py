"""Step 3's held-out evaluation keeps, per prompt, the mean reward and the mean of each reward component (gsm8k:
accuracy, format), in prompt order, so that before/after changes are paired by prompt. A fake experience maker
gives known values; the expected ones are computed by hand."""

from types import SimpleNamespace

import pytest
import torch

from rlhfkit.ppo.evaluate import PROMPT_PARTS, PROMPT_REWARDS, HeldOutEval, paired_gain, part_change_line


class FakeMaker:
    """Two samples per prompt; sample s of prompt i is 'correct' when (i + s + shift) % 3 == 0 and scores 2 then."""

    def __init__(self, shift: int = 0):
        self.cfg = SimpleNamespace(eval_n_samples_per_prompt=2, n_samples_per_prompt=2, per_device_eval_batch_size=2, seed=0)
        self.eval_samples, self.pad, self.device, self.shift = 2, 0, "cpu", shift
        self.models = SimpleNamespace(actor=torch.nn.Identity())

    def make(self, batch, rows, parts, training):
        correct = [float((i + s + self.shift) % 3 == 0) for i in batch["index"].tolist() for s in range(2)]
        parts.setdefault("acc", []).extend(correct)
        n = len(correct)
        exp = SimpleNamespace(raw_scores=2 * torch.tensor(correct), old_logprobs=torch.zeros(n, 1),
                              ref_logprobs=torch.zeros(n, 1), action_mask=torch.ones(n, 1), truncated=torch.zeros(n))
        return exp, None, None


def evaluate(shift: int) -> dict:
    features = [{"prompt_ids": [1, 2], "index": i} for i in (3, 0, 4, 1, 2)]  # not in index order; 5 = 2 + 2 + 1 (+1 pad)
    return HeldOutEval(FakeMaker(shift), features, rows=[{}] * 5, batch_size=2)()


def test_per_prompt_means_in_prompt_order_without_the_padding_row():
    ev = evaluate(shift=0)
    # prompt i: samples (i, i + 1); correct where divisible by 3 -> i=0: (1, 0), 1: (0, 0), 2: (0, 1), 3: (1, 0), 4: (0, 0)
    assert ev[PROMPT_PARTS] == {"acc": [0.5, 0.0, 0.5, 0.5, 0.0]}
    assert ev[PROMPT_REWARDS] == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert ev["acc"] == pytest.approx(3 / 10) and ev["reward"] == pytest.approx(6 / 10)
    assert (ev["prompts"], ev["samples"]) == (5, 10)


def test_paired_change_of_a_reward_part():
    before, after = evaluate(shift=0), evaluate(shift=1)
    # shift 1: i=0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (0, 0), 4: (0, 1) -> [0, .5, .5, 0, .5]
    assert after[PROMPT_PARTS]["acc"] == [0.0, 0.5, 0.5, 0.0, 0.5]
    g = paired_gain(before, after, "acc")
    diffs = [-0.5, 0.5, 0.0, -0.5, 0.5]  # mean 0; sample variance: sum of squares 1.0 / (n - 1) = 0.25
    half = 2.7764451051977987 * (0.25 ** 0.5) / 5 ** 0.5  # t(0.975, 4) * s / sqrt(n)
    assert g["n"] == 5 and g["mean"] == pytest.approx(sum(diffs) / 5)
    assert (g["ci_low"], g["ci_high"]) == (pytest.approx(-half), pytest.approx(half))
    assert paired_gain(before, after)["mean"] == pytest.approx(0.0)  # the reward: 2 x acc
    assert paired_gain(before, after, "missing")["n"] == 0



def test_summary_line_of_a_reward_part_with_two_prompts_and_with_one():
    """The end-of-run line of a reward part: a paired interval from 2 prompts on; one prompt (--max_eval_samples 1,
    as bench/grpo.py runs) has none, and the summary must still print instead of failing after training."""
    before = {"acc": 0.5, PROMPT_PARTS: {"acc": [0.0, 1.0]}}
    after = {"acc": 0.75, PROMPT_PARTS: {"acc": [0.5, 1.0]}}
    # diffs [0.5, 0.0]: mean 0.25, s = sqrt(2 * 0.25^2 / 1) = 0.35355; half = t(0.975, 1) * s / sqrt(2) = 12.7062 * 0.25
    assert part_change_line(before, after, "acc") == (
        "0.500 -> 0.750, change +0.250, 95% CI [-2.927, +3.427] paired over 2 prompts")
    one_before, one_after = {"acc": 0.0, PROMPT_PARTS: {"acc": [0.0]}}, {"acc": 1.0, PROMPT_PARTS: {"acc": [1.0]}}
    assert part_change_line(one_before, one_after, "acc") == "0.000 -> 1.000 (1 prompt: too few for a paired interval)"

def test_evaluation_reads_the_running_reward_moments_and_never_updates_them():
    """--normalize_reward: a held-out batch is normalised with the moments of the training scores so far; it must
    not move them, or held-out prompts would shape training (and a run would depend on --eval_interval)."""
    from rlhfkit.algos import RunningMoments
    from rlhfkit.ppo.collect import ExperienceMaker

    maker = SimpleNamespace(cfg=SimpleNamespace(truncated_reward=None, overlong_buffer_len=0, empty_reward="keep"),
                            reward_norm=RunningMoments())
    out = ExperienceMaker.shaped(maker, torch.tensor([1.0, 3.0]), None, training=True)  # mean 2, var 1
    torch.testing.assert_close(out, torch.tensor([-1.0, 1.0]))
    state = maker.reward_norm.state_dict()
    out = ExperienceMaker.shaped(maker, torch.tensor([10.0]), None, training=False)
    torch.testing.assert_close(out, torch.tensor([8.0]))
    assert maker.reward_norm.state_dict() == state


def test_an_empty_answer_is_scored_as_the_worst_real_one_before_normalisation():
    """--empty_reward min (the default): in training an empty response's score (EOS first) is capped at the lowest
    real one in the batch before the running moments see it; a number replaces it after normalisation; keep
    leaves the reward model's score. A held-out batch keeps the reward model's own scores."""
    from rlhfkit.algos import RunningMoments
    from rlhfkit.ppo.collect import ExperienceMaker

    raw, batch = torch.tensor([1.0, 9.0, 3.0, 2.0]), SimpleNamespace(empty=torch.tensor([False, True, False, False]))
    maker = SimpleNamespace(cfg=SimpleNamespace(truncated_reward=None, overlong_buffer_len=0, empty_reward="min"),
                            reward_norm=RunningMoments())
    out = ExperienceMaker.shaped(maker, raw, batch, training=True)
    # scores 1, 1, 3, 2: mean 1.75, variance (0.75^2 + 0.75^2 + 1.25^2 + 0.25^2) / 4 = 0.6875
    std = 0.6875 ** 0.5
    torch.testing.assert_close(out, torch.tensor([-0.75 / std, -0.75 / std, 1.25 / std, 0.25 / std]))
    assert maker.reward_norm.mean == pytest.approx(1.75)  # the moments saw the capped score, not 9
    torch.testing.assert_close(ExperienceMaker.shaped(SimpleNamespace(cfg=maker.cfg, reward_norm=None), raw, batch, training=False),
                               raw)
    for value, expected in (("-5", [1.0, -5.0, 3.0, 2.0]), ("keep", raw.tolist())):
        maker = SimpleNamespace(cfg=SimpleNamespace(truncated_reward=None, overlong_buffer_len=0, empty_reward=value),
                                reward_norm=None)
        assert ExperienceMaker.shaped(maker, raw, batch, training=True).tolist() == expected
