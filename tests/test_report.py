"""`rlhfkit report`: plots for every series that exists, a headline table with the right numbers, clear errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from PIL import Image

from rlhfkit.cli import main
from rlhfkit.errors import RlhfkitError
from rlhfkit.report import write_report

STEPS = 6


def write_log(out_dir: Path, records: list[dict]) -> None:
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    with open(out_dir / "logs" / "metrics.jsonl", "a", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def rec(program: str, step: int, **values) -> dict:
    return {"program": program, "step": step, "time_s": 10.0 * step, **{k.replace("__", "/"): v for k, v in values.items()}}


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A pipeline run: step1 (SFT), step2 (reward), dpo, step3 (PPO), a few steps of each program's keys."""
    run = tmp_path / "run"
    sft = []
    for s in range(1, STEPS + 1):
        sft.append(rec("sft", s, train__loss=3.0 - 0.25 * s, train__lr=1e-5))  # 2.75 -> 1.5
        if s % 2 == 0:  # eval records are logged separately at the same step
            sft.append(rec("sft", s, eval__loss=2.0 - 0.1 * s, eval__perplexity=20.0 - 2.0 * s))  # 16 -> 8
    write_log(run / "step1", sft)
    write_log(run / "step2", [rec("reward", s, train__loss=0.75 - 0.05 * s, eval__accuracy=0.5 + 0.05 * s,
                                  eval__margin=0.125 * s) for s in range(1, STEPS + 1)])  # acc 0.55 -> 0.8, margin 0.125 -> 0.75
    write_log(run / "dpo", [rec("dpo", s, train__loss=0.625 - 0.0625 * s, eval__accuracy=0.5 + 0.0625 * s,
                                eval__margin=0.25 * s) for s in range(1, STEPS + 1)])
    write_log(run / "step3", [rec("ppo", s, reward__score_mean=-1.0 + 0.5 * s, kl__per_token=0.01 * s, kl__per_seq=0.3 * s,
                                  policy__loss=-0.1 * s, policy__clip_frac=0.05 * s, value__loss=1.0 / s,
                                  policy__entropy=2.0 - 0.125 * s, gen__response_len=40.0 + 4 * s, gen__truncated_rate=0.1,
                                  time__generation_s=6.0, time__experience_s=1.5, time__training_s=3.0)
                              for s in range(1, STEPS + 1)])
    return run


EXPECTED_PNGS = [
    "step1_loss.png", "step1_perplexity.png",
    "step2_loss.png", "step2_accuracy.png", "step2_margin.png",
    "dpo_loss.png", "dpo_accuracy.png", "dpo_margin.png",
    "step3_reward.png", "step3_kl.png", "step3_policy_loss.png", "step3_clip_frac.png", "step3_value_loss.png",
    "step3_entropy.png", "step3_response_len.png", "step3_time.png",
]


def headline_rows(md: str) -> dict[str, str]:
    table = md.split("\n\n")[1]
    return {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}


def test_report_writes_every_plot_and_the_headline_table(run_dir, tmp_path, capsys):
    out = tmp_path / "rep"
    main(["report", str(run_dir), "--out", str(out)])
    assert "report written to" in capsys.readouterr().out

    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == sorted(EXPECTED_PNGS)
    for name in EXPECTED_PNGS:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
        with Image.open(out / name) as im:
            im.verify()
            assert im.size[0] > 300 and im.size[1] > 200

    md = (out / "report.md").read_text()
    rows = headline_rows(md)
    assert list(rows) == ["step1", "step2", "dpo", "step3"]  # pipeline order
    assert re.search(r"\| step1 \| sft \| 6 \| 9 \| 1m 00s \|", rows["step1"])
    assert "train/loss 2.75 → 1.5" in rows["step1"] and "eval/perplexity 16 → 8" in rows["step1"]
    assert "eval/loss 1.8 → 1.4" in rows["step1"]
    assert "| step2 | reward | 6 |" in rows["step2"]
    assert "train/loss 0.7 → 0.45" in rows["step2"] and "eval/accuracy 0.55 → 0.8" in rows["step2"]
    assert "eval/margin 0.125 → 0.75" in rows["step2"]
    assert "eval/accuracy 0.5625 → 0.875" in rows["dpo"] and "eval/margin 0.25 → 1.5" in rows["dpo"]
    assert "reward/score_mean -0.5 → 2" in rows["step3"] and "kl/per_token 0.01 → 0.06" in rows["step3"]
    for name in EXPECTED_PNGS:
        assert f"]({name})" in md  # every plot embedded
    assert "| value/loss | 6 | 1 | 0.1667 | 0.1667 | 1 |" in md  # per-stage detail table


def test_gsm8k_rule_parts_get_their_plot(tmp_path):
    """A rule-rewarded run's accuracy and answer-format rates, per training step and at each evaluation."""
    run = tmp_path / "run"
    train = [rec("grpo", s, reward__score_mean=0.1 * s, reward__gsm8k_accuracy=0.01 * s, reward__gsm8k_format=0.1 * s)
             for s in range(1, 5)]
    evals = [rec("grpo", s, eval__reward=0.1, eval__gsm8k_accuracy=0.02, eval__gsm8k_format=0.1 + 0.2 * s) for s in (0, 4)]
    write_log(run / "grpo", train + evals)
    report = write_report(run, tmp_path / "rep", echo=False)
    assert (report.parent / "grpo_gsm8k.png").exists() and "](grpo_gsm8k.png)" in report.read_text()
    write_log(tmp_path / "plain" / "grpo", [rec("grpo", s, reward__score_mean=0.1 * s) for s in range(1, 3)])
    assert not (write_report(tmp_path / "plain", tmp_path / "rep2", echo=False).parent / "grpo_gsm8k.png").exists()


def test_step3_held_out_learning_curve(tmp_path):
    """Step 3's held-out evaluation (eval/*, logged at step 0 and every --eval_interval) gets its own plots, the
    reward with a shaded 95% band (+- 1.96 standard errors over prompts), and its first -> last in the headline."""
    run = tmp_path / "run"
    train = [rec("grpo", s, reward__score_mean=0.1 * s, kl__per_token=0.01 * s) for s in range(1, 7)]
    evals = [rec("grpo", s, eval__reward=-1.0 + 0.25 * s, eval__reward_se=0.5, eval__kl_per_token=0.02 * s,
                 eval__kl_per_seq=0.5 * s) for s in (0, 3, 6)]  # -1 -> 0.5; KL 0 -> 0.12
    write_log(run / "step3", train + evals)
    report = write_report(run, tmp_path / "rep", echo=False)
    md = report.read_text()
    assert sorted(p.name for p in report.parent.glob("*.png")) == ["step3_eval_kl.png", "step3_eval_reward.png", "step3_kl.png",
                                                                    "step3_reward.png"]
    assert "](step3_eval_reward.png)" in md and "](step3_eval_kl.png)" in md
    assert "eval/reward -1 → 0.5; eval/kl_per_token 0 → 0.12" in headline_rows(md)["step3"]
    # the band: matplotlib's first colour (31, 119, 180) at alpha 0.2 over white, (210, 228, 240), fills a large area
    with Image.open(report.parent / "step3_eval_reward.png") as im:
        band = sum(k for k, c in im.convert("RGB").getcolors(maxcolors=1 << 20) if all(abs(a - b) <= 3 for a, b in zip(c, (210, 228, 240))))
    assert band > 5000, band


def test_judges_against_kl_and_length(tmp_path):
    """Step 3's --judge: the held-out rewards of the training reward model and of the judge over the steps, and
    against the held-out KL and response length (x = that series, matched by step, not the step)."""
    run = tmp_path / "run"
    evals = [rec("ppo", s, eval__reward=0.25 * s, eval__judge=0.1 * s, eval__kl_per_token=0.01 * s, eval__response_len=40 - s)
             for s in (0, 3, 6)]
    write_log(run / "step3", evals)
    report = write_report(run, tmp_path / "rep", echo=False)
    pngs = {p.name for p in report.parent.glob("*.png")}
    assert {"step3_eval_judge.png", "step3_eval_vs_kl.png", "step3_eval_vs_length.png"} <= pngs
    from rlhfkit.report import PLOTS, _draw_against, load_run

    stage = load_run(run)[0]
    spec = next(p for p in PLOTS["ppo"] if p.name == "eval_vs_kl")

    class Axes:  # records what would be drawn
        def plot(self, x, y, **kw):
            self.drawn = (list(x), list(y))
            return [kw["label"]]

        def annotate(self, *a, **kw):
            pass

    ax = Axes()
    assert _draw_against(ax, stage, spec.right, spec.x, ["k"] * 4) == ["eval/judge"]
    assert ax.drawn == (pytest.approx([0.0, 0.03, 0.06]), pytest.approx([0.0, 0.3, 0.6]))


def test_only_existing_series_are_plotted_and_default_out(tmp_path):
    run = tmp_path / "sft_only"
    write_log(run, [rec("sft", s, train__loss=1.0 / s) for s in range(1, 4)])  # the program's own output dir
    report = write_report(run, echo=False)
    assert report == run / "report" / "report.md"
    assert sorted(p.name for p in report.parent.glob("*.png")) == ["sft_loss.png"]
    assert "| . | sft | 3 |" in report.read_text()
    write_report(run, echo=False)  # a second report does not read its own output


def test_resumed_and_cut_short_logs(tmp_path):
    run = tmp_path / "run"
    write_log(run / "step1", [rec("sft", s, train__loss=float(10 - s)) for s in range(1, 5)])
    write_log(run / "step1", [rec("sft", s, train__loss=float(20 - s)) for s in range(3, 6)])  # resumed at step 3
    with open(run / "step1" / "logs" / "metrics.jsonl", "a") as f:
        f.write('{"program": "sft", "step": 6, "train/lo')  # killed mid-write
    md = write_report(run, echo=False).read_text()
    assert "train/loss 9 → 15" in headline_rows(md)["step1"]
    assert "1 unreadable line(s) skipped (line 8)" in md


@pytest.mark.parametrize("layout", ["missing", "empty_dir", "empty_file"])
def test_nothing_to_report_is_a_clear_error(tmp_path, capsys, layout):
    run = tmp_path / "run"
    if layout != "missing":
        run.mkdir()
    if layout == "empty_file":
        (run / "step1" / "logs").mkdir(parents=True)
        (run / "step1" / "logs" / "metrics.jsonl").write_text("")
    with pytest.raises(RlhfkitError):
        write_report(run, tmp_path / "out", echo=False)
    with pytest.raises(SystemExit) as e:
        main(["report", str(run)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: report:") and str(run) in err and "Traceback" not in err
    assert {"missing": "does not exist", "empty_dir": "no logs/metrics.jsonl", "empty_file": "hold no metrics"}[layout] in err


def test_step3_algorithms_come_from_the_registry(monkeypatch, tmp_path):
    """Every --algo of rlhfkit.rl.ALGOS gets PPO's rows and plots; a newly registered algorithm too,
    with no change to report.py."""
    from rlhfkit import rl
    from rlhfkit.report import program_family

    assert {a: program_family(a) for a in rl.ALGOS} == {a: "ppo" for a in rl.ALGOS}
    assert [program_family(p) for p in ("reinforce++", "ipo", "sft", "dpo", "mystery")] == ["ppo", "dpo", "sft", "dpo", "mystery"]
    monkeypatch.setitem(rl.ALGOS, "my_algo", rl.ALGOS["grpo"])
    run = tmp_path / "run"
    write_log(run / "step3", [rec("my_algo", s, reward__score_mean=float(s), kl__per_token=0.01 * s) for s in (1, 2)])
    report = write_report(run, tmp_path / "rep", echo=False)
    assert sorted(p.name for p in report.parent.glob("*.png")) == ["step3_kl.png", "step3_reward.png"]
    assert "reward/score_mean 1 → 2; kl/per_token 0.01 → 0.02" in headline_rows(report.read_text())["step3"]


def test_markdown_cells_and_fences():
    from rlhfkit.rendering import fence, fmt, md_escape

    assert md_escape("a|b") == "a\\|b"
    assert fence("x = `y`", 100) == "```text\nx = `y`\n```"
    assert fence("a\n````\nb", 100) == "`````text\na\n````\nb\n`````"  # longer than any backtick run inside
    assert fence("abcdef", 4) == "```text\nabcd [...]\n```"
    assert [fmt(v) for v in (None, 0.0, 1234.5678, 0.0001234, 2.5e6, float("nan"))] == ["–", "0", "1235", "1.234e-04", "2.500e+06", "nan"]


def test_held_out_outcomes_state_each_target_met_or_missed(run_dir, capsys):
    """The outcome lines read the stage manifests and say 'met' or 'MISSED' for each target, with the numbers."""
    from rlhfkit.outcomes import Targets, outcome_lines

    def manifest(path: Path, metrics: dict) -> None:
        path.mkdir(parents=True, exist_ok=True)
        (path / "rlhfkit.json").write_text(json.dumps({"stage": "x", "metrics": metrics}))

    rm = {"eval_accuracy_before": 0.48, "eval_accuracy_after": 0.62, "eval_accuracy_ci": [0.555, 0.68], "eval_pairs": 227,
          "eval_longer_baseline": 0.47, "eval_chosen_shorter_accuracy": 0.86, "eval_chosen_shorter_pairs": 118}
    manifest(run_dir / "step2", rm)
    ppo = {"eval_reward_before": 0.17, "eval_reward_after": 0.24, "eval_reward_gain": 0.07, "eval_reward_gain_ci": [0.03, 0.11],
           "eval_prompts": 64, "eval_kl_per_token_after": 0.0063}
    manifest(run_dir / "step3" / "actor", ppo)
    lines = outcome_lines(run_dir)
    assert lines[0].startswith("step 2 (reward model): held-out accuracy 0.620, 95% CI [0.555, 0.680], on 227 pairs")
    assert lines[0].endswith(": met") and "'prefer the longer answer' 0.470" in lines[1] and "0.860 on the 118 pairs" in lines[1]
    assert "gain +0.0700, paired 95% CI [+0.0300, +0.1100] over 64 prompts; KL 0.0063 nats per token" in lines[2]
    assert lines[2].endswith(": met")
    # each condition of a target can miss it: the accuracy, the CI's lower end, the number of pairs / prompts
    for change in ({"eval_accuracy_after": 0.59}, {"eval_accuracy_ci": [0.49, 0.7]}, {"eval_pairs": 127}):
        manifest(run_dir / "step2", {**rm, **change})
        assert outcome_lines(run_dir)[0].endswith(": MISSED"), change
    for change in ({"eval_reward_gain_ci": [-0.01, 0.11]}, {"eval_prompts": 63}):
        manifest(run_dir / "step3" / "actor", {**ppo, **change})
        assert outcome_lines(run_dir)[2].endswith(": MISSED"), change
    assert outcome_lines(run_dir, Targets(rm_accuracy=0.65))[0].endswith(": MISSED")
    # a quality run (pipeline.json names its size) has its own targets: accuracy >= 0.65 on >= 256 pairs
    (run_dir / "pipeline.json").write_text(json.dumps({"size": "quality"}))
    manifest(run_dir / "step2", rm)
    assert outcome_lines(run_dir)[0].endswith(": MISSED") and ">= 0.65" in outcome_lines(run_dir)[0]
    (run_dir / "pipeline.json").unlink()
    # report prints them and puts them at the top of report.md
    report = write_report(run_dir)
    assert "==== held-out outcomes ====" in capsys.readouterr().out
    assert "## Held-out outcomes" in report.read_text().split("| Stage |")[0]


def test_step2_outcome_holds_for_each_preference_set(tmp_path):
    """A reward model trained on two preference sets meets its target only if each set's held-out figures do."""
    from rlhfkit.outcomes import Targets, reward_model_lines

    hh = {"accuracy": 0.62, "accuracy_ci_low": 0.555, "accuracy_ci_high": 0.68, "pairs": 227, "longer_baseline": 0.47,
          "chosen_shorter_accuracy": 0.86, "chosen_shorter_pairs": 118}
    helpful = {**hh, "accuracy": 0.66, "pairs": 132, "longer_baseline": 0.70, "chosen_shorter_accuracy": 0.35,
               "chosen_shorter_pairs": 40}
    rm = {"eval_accuracy_before": 0.5, "eval_accuracy_after": 0.635, "eval_accuracy_ci": [0.584, 0.683], "eval_pairs": 359,
          "eval_by_source": {"hh-rlhf-harmless-base": hh, "alpaca-eval-prefs": helpful}}
    lines = reward_model_lines(rm, Targets())
    assert lines[0].endswith("on >= 128 pairs of each preference set: met")
    assert lines[2] == ("  alpaca-eval-prefs: accuracy 0.660, 95% CI [0.555, 0.680], on 132 pairs: met; 'prefer the longer answer' "
                        "0.700; the model 0.350 on the 40 pairs whose chosen answer is the shorter")
    # one set short of pairs, or at chance, misses the step's target though the blend meets it
    for change in ({"pairs": 127}, {"accuracy": 0.58}, {"accuracy_ci_low": 0.49}):
        lines = reward_model_lines({**rm, "eval_by_source": {"hh-rlhf-harmless-base": hh, "alpaca-eval-prefs": {**helpful, **change}}},
                                   Targets())
        assert lines[0].endswith(": MISSED"), change
        assert ": MISSED;" in lines[2] and ": met;" in lines[1], change


def test_quality_outcomes_judge_and_win_rates(tmp_path):
    """--size quality: the judge's accuracy against the proxy's, step 3's change under the judge, and rlhfkit eval's
    win rates (>= 0.60 under both reward models) and the judge's length-controlled win rate (>= 0.55)."""
    from rlhfkit.outcomes import outcome_lines

    run = tmp_path / "run"
    for sub, metrics in (("step2", {"eval_accuracy_before": 0.5, "eval_accuracy_after": 0.66, "eval_accuracy_ci": [0.6, 0.72],
                                    "eval_pairs": 257}),
                         ("judge", {"eval_accuracy_before": 0.5, "eval_accuracy_after": 0.64, "eval_accuracy_ci": [0.56, 0.72],
                                    "eval_pairs": 151}),
                         ("step3/actor", {"eval_reward_before": 0.1, "eval_reward_after": 0.3, "eval_reward_gain": 0.2,
                                          "eval_reward_gain_ci": [0.1, 0.3], "eval_prompts": 128, "eval_judge_before": 1.0,
                                          "eval_judge_after": 0.9, "eval_judge_change": -0.1, "eval_judge_change_ci": [-0.2, 0.0]})):
        (run / sub).mkdir(parents=True)
        (run / sub / "rlhfkit.json").write_text(json.dumps({"stage": "x", "metrics": metrics}))
    (run / "pipeline.json").write_text(json.dumps({"size": "quality"}))
    (run / "eval").mkdir()
    cmp = {"win_rate_ties_half": 0.62, "win_rate_ties_half_ci": [0.55, 0.69], "lc_win_rate": 0.58, "lc_win_rate_ci": [0.5, 0.66]}
    judge = {"win_rate_ties_half": 0.61, "win_rate_ties_half_ci": [0.54, 0.68], "lc_win_rate": 0.54, "lc_win_rate_ci": [0.46, 0.62]}
    results = {"prompts": {"count": 128, "samples_per_prompt": 4}, "comparison": cmp, "judges": {"/j": {"comparison": judge}}}
    (run / "eval" / "results.json").write_text(json.dumps(results))
    lines = outcome_lines(run)
    text = "\n".join(lines)
    assert lines[0].endswith(": met")  # 0.66 >= 0.65 on 257 pairs
    assert "independent judge (judge/): held-out accuracy 0.640" in lines[1] and lines[1].endswith("0.660: MISSED")
    assert "step 3 under judge: held-out 1.0000 -> 0.9000, change -0.1000, paired 95% CI [-0.2000, +0.0000]" in text
    assert "win rate 0.620 [0.550, 0.690], length-controlled 0.580 [0.500, 0.660], over 128 prompts x 4 samples" in text
    assert lines[-2].endswith(": met") and lines[-1].endswith(": MISSED")  # the judge's length-controlled 0.54 < 0.55
    judge["lc_win_rate"] = 0.56
    (run / "eval" / "results.json").write_text(json.dumps(results))
    assert outcome_lines(run)[-1].endswith(": met")
    results["prompts"]["samples_per_prompt"] = 1  # one sample per prompt is not "several"
    (run / "eval" / "results.json").write_text(json.dumps(results))
    assert outcome_lines(run)[-1].endswith(": MISSED") and outcome_lines(run)[-2].endswith(": MISSED")


def test_a_gain_that_comes_with_empty_answers_is_not_met(tmp_path):
    """Reward models never see an empty answer (EOS first) and may score it high: step 3's gain and the win rates
    are not met when the actor answers nothing more often than the step-1 model, by more than 1 point."""
    from rlhfkit.outcomes import outcome_lines

    run = tmp_path / "run"
    actor = {"eval_reward_before": 0.1, "eval_reward_after": 0.17, "eval_reward_gain": 0.07, "eval_reward_gain_ci": [0.06, 0.08],
             "eval_prompts": 128, "eval_empty_rate_before": 0.0, "eval_empty_rate_after": 0.49}
    (run / "step3" / "actor").mkdir(parents=True)
    (run / "pipeline.json").write_text(json.dumps({"size": "quality"}))
    (run / "eval").mkdir()
    win = {"win_rate_ties_half": 0.86, "win_rate_ties_half_ci": [0.82, 0.89], "lc_win_rate": 0.69, "lc_win_rate_ci": [0.62, 0.76]}
    results = {"prompts": {"count": 128, "samples_per_prompt": 4}, "comparison": win, "judges": {"/j": {"comparison": win}},
               "models": {"actor": {"empty_rate": 0.49}, "baseline": {"empty_rate": 0.0}}}

    def lines(after: float) -> list[str]:
        actor["eval_empty_rate_after"] = results["models"]["actor"]["empty_rate"] = after
        (run / "step3" / "actor" / "rlhfkit.json").write_text(json.dumps({"stage": "ppo", "metrics": actor}))
        (run / "eval" / "results.json").write_text(json.dumps(results))
        return [x for x in outcome_lines(run) if "step 3" in x or "win rate" in x or "empty" in x]

    got = lines(0.49)
    assert "empty responses 0.0% -> 49.0%" in got[0] and got[0].endswith(": MISSED")
    assert got[1].endswith(": MISSED") and got[3].endswith(": MISSED")  # the reward model's and the judge's win rates
    assert got[2] == "  empty responses: baseline 0.0%, actor 49.0% (the targets also need empty answers at most 1% above the baseline's)"
    got = lines(0.01)  # within the point of slack: met
    assert got[0].endswith(": met") and got[1].endswith(": met") and got[3].endswith(": met")
    assert len(lines(0.0)) == 3  # no empty answers on either side: no line about them


def test_quality_step2_judges_a_length_biased_set_by_its_baselines():
    """--size quality: on a set where "prefer the longer answer" is right more often than not (its Wilson interval
    above 0.5), the reward model must beat that baseline and reach 0.55 where the chosen answer is the shorter; a
    set without that bias (hh harmless, or a baseline whose interval holds 0.5) keeps the 0.65 target."""
    from rlhfkit.outcomes import TARGETS, Targets, reward_model_lines

    hh = {"accuracy": 0.66, "accuracy_ci_low": 0.60, "accuracy_ci_high": 0.72, "pairs": 257, "longer_baseline": 0.47,
          "chosen_shorter_accuracy": 0.80, "chosen_shorter_pairs": 130}
    # 177 of 260 pairs have the longer answer chosen: 0.681, Wilson 95% interval [0.622, 0.734], above 0.5
    helpful = {"accuracy": 0.70, "accuracy_ci_low": 0.64, "accuracy_ci_high": 0.75, "pairs": 260, "longer_baseline": 177 / 260,
               "chosen_shorter_accuracy": 0.56, "chosen_shorter_pairs": 80}
    rm = {"eval_accuracy_before": 0.5, "eval_accuracy_after": 0.68, "eval_accuracy_ci": [0.64, 0.72], "eval_pairs": 517}

    def verdicts(h, helpful_set, targets=TARGETS["quality"]):
        lines = reward_model_lines({**rm, "eval_by_source": {"hh": h, "help": helpful_set}}, targets)
        return [re.search(r": (met|MISSED)", line).group(1) for line in lines]

    assert verdicts(hh, helpful) == ["met", "met", "met"]
    lines = reward_model_lines({**rm, "eval_by_source": {"hh": hh, "help": helpful}}, TARGETS["quality"])
    assert lines[2].startswith("  help: accuracy 0.700, 95% CI [0.640, 0.750], on 260 pairs (length-biased: target above "
                               "the longer-answer baseline and >= 0.55 where the chosen answer is the shorter): met;")
    assert verdicts(hh, {**helpful, "accuracy": 0.68}) == ["MISSED", "met", "MISSED"]  # 0.680 < the baseline 0.681
    assert verdicts(hh, {**helpful, "chosen_shorter_accuracy": 0.54}) == ["MISSED", "met", "MISSED"]
    assert verdicts(hh, {**helpful, "pairs": 255, "longer_baseline": 0.68}) == ["MISSED", "met", "MISSED"]
    assert verdicts({**hh, "accuracy": 0.64}, helpful) == ["MISSED", "MISSED", "met"]
    # 138 of 260 (0.531, interval [0.470, 0.590]) is no evidence of a length bias: the 0.65 target applies
    assert verdicts(hh, {**helpful, "longer_baseline": 138 / 260, "accuracy": 0.64}) == ["MISSED", "met", "MISSED"]
    # the default run's targets have no length rule: 0.61 >= 0.60 passes whatever the baseline
    assert verdicts(hh, {**helpful, "accuracy": 0.61}, Targets()) == ["met", "met", "met"]


def test_outcomes_of_a_one_prompt_evaluation_have_no_interval_and_miss(tmp_path):
    """A held-out evaluation of one prompt (a smoke run, bench/grpo.py) has a gain but no paired interval
    (``mean_ci`` gives None): the lines say so and the target is missed, instead of failing to format."""
    from rlhfkit.outcomes import outcome_lines

    actor = tmp_path / "step3" / "actor"
    actor.mkdir(parents=True)
    m = {"eval_reward_before": 0.1, "eval_reward_after": 0.25, "eval_reward_gain": 0.15, "eval_reward_gain_ci": [None, None],
         "eval_prompts": 1, "eval_judge_j_before": 1.0, "eval_judge_j_after": 2.5, "eval_judge_j_change": 1.5,
         "eval_judge_j_change_ci": [None, None]}
    (actor / "rlhfkit.json").write_text(json.dumps({"stage": "ppo", "metrics": m}))
    lines = [x for x in outcome_lines(tmp_path) if "step 3" in x]
    assert "gain +0.1500, paired 95% CI none (fewer than 2 prompts) over 1 prompts" in lines[0]
    assert lines[0].endswith(": MISSED")
    assert lines[1] == "  step 3 under judge_j: held-out 1.0000 -> 2.5000, change +1.5000, paired 95% CI none (fewer than 2 prompts)"
