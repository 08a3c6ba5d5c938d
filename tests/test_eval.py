"""`rlhfkit eval` on tiny models: every reported number recomputed from the per-prompt rows, valid plots,
the held-out step-3 prompts, determinism for a seed, actor == baseline gives KL 0 and all ties, clear errors."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest
import torch
from PIL import Image

from rlhfkit.cli import main
from rlhfkit.errors import CheckpointError, ConfigError, RlhfkitError
from rlhfkit.evaluation import EvalOptions, mean_ci, run_eval, t_quantile
from rlhfkit.rendering import fmt
from rlhfkit.rewards import gsm8k_reward

# Student t 0.975 quantiles (from tables) for the sample sizes below: n = 5 -> df 4, n = 8 -> df 7.
T975 = {1: 12.706204736174705, 3: 3.182446305284263, 4: 2.7764451051977987, 7: 2.3646242510102993, 9: 2.2621571627409915, 30: 2.0422724563012373}
MATH = [{"question": f"Tom has {i} apples and buys {i + 3} more. How many apples does he have?",
         "answer": f"{i} + {i + 3} = {2 * i + 3}\n#### {2 * i + 3}"} for i in range(16)]
STEP3 = {"data_split": "0,0,1", "seed": 7, "eval_fraction": 0.5, "max_eval_samples": 5, "max_prompt_seq_len": 64}
TOKENS = 6  # --max_new_tokens


def length_reward(prompts, responses, rows):
    """A custom reward (module:function): the response's length in characters, so numbers vary with the gibberish."""
    return [float(len(r)) for r in responses]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("evaldata") / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in MATH))
    return path


def _save(model, tokenizer, out, stage, config=None):
    from rlhfkit.checkpoint import build_manifest, write_manifest

    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    write_manifest(out, build_manifest(stage=stage, config=config or {}, tokenizer=tokenizer))
    return out


@pytest.fixture(scope="module")
def dirs(tiny_dir, tokenizer, data, tmp_path_factory):
    """actor (stage 'actor', trained on `data` by the manifest), sft (a perturbed copy), reward and judge (random score heads)."""
    from rlhfkit.models import load_model

    root = tmp_path_factory.mktemp("evalmodels")
    out = {}
    for name, seed in (("actor", 1), ("sft", 2)):
        torch.manual_seed(seed)
        model = load_model(str(tiny_dir), "causal_lm", dtype="fp32", pad_token_id=tokenizer.pad_token_id)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        config = {**STEP3, "data_path": [str(data)]} if name == "actor" else {}
        out[name] = _save(model, tokenizer, root / name, name, config)
    for name, seed in (("reward", 3), ("judge", 4)):
        torch.manual_seed(seed)
        rm = load_model(str(tiny_dir), "reward", dtype="fp32", pad_token_id=tokenizer.pad_token_id)
        rm.score.weight.data.normal_(0, 1.0)
        out[name] = _save(rm, tokenizer, root / name, "reward")
    return out


def run(capsys, *args):
    main(["eval", "--max_new_tokens", str(TOKENS), "--batch_size", "4", "--dtype", "fp32", "--device", "cpu", *map(str, args)])
    return capsys.readouterr().out


def close(a, b, tol=1e-9):
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b))


def per_prompt(values, n_samples):
    """Each prompt's mean over its samples (a prompt's samples are consecutive rows)."""
    return [statistics.fmean(values[i:i + n_samples]) for i in range(0, len(values), n_samples)]


def t_interval(values):
    """(mean, std, half width) of the 95% Student t interval, from the table of T975."""
    n, mean, sd = len(values), statistics.fmean(values), statistics.stdev(values)
    return mean, sd, T975[n - 1] * sd / math.sqrt(n)


def check_numbers(out_dir, names=("actor", "baseline")):
    """Recompute every headline number from results.json's rows; check report.md shows them."""
    res = json.loads((out_dir / "results.json").read_text())
    rows, md = res["rows"], (out_dir / "report.md").read_text()
    n, n_samples = res["prompts"]["count"], res["prompts"]["samples_per_prompt"]
    assert len(rows) == res["prompts"]["responses"] == n * n_samples and [r["index"] for r in rows] == list(range(n * n_samples))
    assert [(r["prompt_index"], r["sample"]) for r in rows] == [(k // n_samples, k % n_samples) for k in range(len(rows))]
    for name in names:
        m, rewards = res["models"][name], [r[name]["reward"] for r in rows]
        for r in rows:  # the total is the sum of the components that exist
            comps = [r[name][k] for k in ("reward_model", "reward_fn") if k in r[name]]
            assert comps and close(r[name]["reward"], sum(comps))
        mean, sd, half = t_interval(per_prompt(rewards, n_samples))  # the interval is over prompts, not samples
        assert close(m["reward"]["mean"], mean) and close(m["reward"]["std"], sd) and close(m["reward"]["ci_half_width"], half, 1e-7)
        assert m["reward"]["n"] == n and close(m["reward"]["ci_low"], mean - half, 1e-7) and close(m["reward"]["ci_high"], mean + half, 1e-7)
        assert close(m["response_tokens_mean"], statistics.fmean(r[name]["tokens"] for r in rows))
        assert close(m["truncated_rate"], sum(r[name]["truncated"] for r in rows) / len(rows))
        assert all(1 <= r[name]["tokens"] <= TOKENS for r in rows)
        assert all(r[name]["tokens"] == TOKENS for r in rows if r[name]["truncated"])
        assert f"| {name} | {fmt(mean)} ± {fmt(half)} [{fmt(mean - half)}, {fmt(mean + half)}] | " in md
    if "baseline" in names:
        check_comparison(res["comparison"], rows, lambda r, name: r[name]["reward"], [r["outcome"] for r in rows], n_samples)
        c, M = res["comparison"], len(rows)
        assert f"| reward | {c['wins']} | {c['ties']} | {c['losses']} | {fmt((c['wins'] + c['ties'] / 2) / M)} [" in md
        kl = res["kl"]
        for r in rows:
            assert close(r["kl_k1"], r["logprob_actor"] - r["logprob_baseline"]) and r["kl_k3"] >= 0
        toks = sum(r["actor"]["tokens"] for r in rows)
        k1, k3 = math.fsum(r["kl_k1"] for r in rows), math.fsum(r["kl_k3"] for r in rows)
        assert kl["estimator"] == "k3" and kl["tokens"] == toks and close(kl["per_token"], k3 / toks) and close(kl["per_sequence"], k3 / M)
        assert close(kl["k1"]["per_token"], k1 / toks) and close(kl["k1"]["per_sequence"], k1 / M)
        assert close(kl["per_sequence_ci"]["mean"], k3 / M) and kl["per_sequence_ci"]["n"] == n
        assert f"per token (k3): {fmt(k3 / toks)}" in md and f"per sequence (k3): {fmt(k3 / M)}" in md
    assert "## Examples" in md and "Student t" in md
    return res


def check_comparison(c, rows, score, outcomes, n_samples):
    """One scorer's actor-vs-baseline numbers, recomputed from the rows: outcomes pair by pair, the counts,
    the win rate (ties as half) inside its bootstrap interval's range, the paired difference over prompts."""
    expected = []
    for r in rows:
        a, b = score(r, "actor"), score(r, "baseline")
        if r["same_response"]:
            assert r["actor"]["response"] == r["baseline"]["response"] and r["actor"]["tokens"] == r["baseline"]["tokens"]
        expected.append("tie" if r["same_response"] or abs(a - b) <= 1e-6 else "win" if a > b else "loss")
    assert outcomes == expected
    w, t, lo = (expected.count(k) for k in ("win", "tie", "loss"))
    assert (c["wins"], c["ties"], c["losses"]) == (w, t, lo) and w + t + lo == len(rows)
    assert close(c["win_rate"], w / len(rows)) and close(c["win_rate_ties_half"], (w + t / 2) / len(rows))
    for key in ("win_rate_ties_half_ci", "lc_win_rate_ci"):
        assert 0 <= c[key][0] <= c[key][1] <= 1
    assert 0 <= c["lc_win_rate"] <= 1
    diffs = per_prompt([score(r, "actor") - score(r, "baseline") for r in rows], n_samples)
    assert close(c["reward_difference"]["mean"], statistics.fmean(diffs)) and c["reward_difference"]["n"] == len(diffs)


def check_png(path):
    assert path.stat().st_size > 8_000, path
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.size[0] >= 500 and im.size[1] >= 400
        colors = im.convert("RGB").getcolors(maxcolors=1 << 20)
        assert len(colors) > 20  # axes, text, bars / points in two colours, not a blank canvas
        colored = sum(k for k, c in colors if max(c) - min(c) > 60)  # bars / points / lines, not greys
        assert colored > 200


# ----------------------------------------------------------------------------------------------


def test_t_quantile_and_ci():
    for df, t in T975.items():
        assert abs(t_quantile(0.975, df) - t) < 1e-8
    assert abs(t_quantile(0.975, 1e7) - 1.959963984540054) < 1e-5 and abs(t_quantile(0.025, 4) + T975[4]) < 1e-8
    s = mean_ci([1.0, 2.0, 3.0, 4.0])  # mean 2.5, s = sqrt(5/3), t(0.975, 3) = 3.182446305284263
    assert s["mean"] == 2.5 and abs(s["ci_half_width"] - 3.182446305284263 * math.sqrt(5 / 3) / 2) < 1e-9
    assert mean_ci([3.0])["ci_half_width"] is None


def test_outcomes_win_rates_and_kl_by_hand():
    from rlhfkit.eval_stats import kl_stats, outcome, win_stats

    # a tie: the same response, or rewards within 1e-6
    assert [outcome(1.0, 0.5, False), outcome(0.5, 1.0, False), outcome(1.0, 1.0 + 5e-7, False), outcome(2.0, 1.0, True)] == \
        ["win", "loss", "tie", "tie"]
    # 2 wins, 1 tie, 1 loss of 4: ties as half (2 + 0.5) / 4; decided 2 / (2 + 1)
    assert win_stats(["win", "win", "tie", "loss"]) == {
        "wins": 2, "ties": 1, "losses": 1, "win_rate": 0.5, "tie_rate": 0.25, "loss_rate": 0.25,
        "win_rate_ties_half": 0.625, "win_rate_decided": 2 / 3}
    assert win_stats([])["win_rate"] is None and win_stats(["tie"])["win_rate_decided"] is None
    # per sequence (0.5 + 1.5) / 2 prompts; per token (0.5 + 1.5) / (2 + 6) tokens
    assert kl_stats([0.5, 1.5], [2, 6]) == {"per_sequence": 1.0, "per_token": 0.25, "tokens": 8}
    assert kl_stats([], []) == {"per_sequence": None, "per_token": None, "tokens": 0}


def test_length_controlled_win_rate_by_hand():
    from rlhfkit.eval_stats import lc_win_rate

    # every length difference 0: the slope stays 0 and sigmoid(a) is the plain win rate, ties as half: (1 + 0.5 + 0 + 1) / 4
    assert abs(lc_win_rate([1, 0.5, 0, 1], [0, 0, 0, 0]) - (1 + 0.5 + 0 + 1) / 4) < 1e-12
    # two length differences, -5 and +5 tokens: the model is saturated, sigmoid(a - b) = 1/2 (1 win of 2 pairs) and
    # sigmoid(a + b) = 3/4 (3 of 4), so a = (logit 1/2 + logit 3/4) / 2 = ln(3) / 2 and sigmoid(a) = sqrt(3) / (sqrt(3) + 1)
    # = 0.634, below the plain 4/6 = 0.667: the actor wins more where it is longer
    wins, diffs = [1, 0, 1, 1, 1, 0], [-5, -5, 5, 5, 5, 5]
    assert abs(lc_win_rate(wins, diffs) - math.sqrt(3) / (math.sqrt(3) + 1)) < 1e-6
    assert abs(lc_win_rate(wins, [d * 7 for d in diffs]) - lc_win_rate(wins, diffs)) < 1e-9  # tokens or any unit
    # weights act as repeated pairs: weight 2 on the first pair = that pair twice
    assert abs(lc_win_rate(wins, diffs, [[2, 1, 1, 1, 1, 1]], scale=5.0)[0] - lc_win_rate([1] + wins, [-5] + diffs, scale=5.0)) < 1e-9


def test_bootstrap_pieces_by_hand():
    import numpy as np

    from rlhfkit.eval_stats import group_means, percentile_interval, resample_weights, win_rate_intervals

    assert group_means([1.0, 3.0, 10.0, 20.0, 5.0], [0, 0, 1, 1, 2]) == [2.0, 15.0, 5.0]
    # resample 1 draws prompt 0 twice, resample 2 prompts 1 and 2: each item weighs its prompt's count
    assert resample_weights(np.array([[0, 0, 2], [1, 2, 2]]), [0, 0, 1, 2]).tolist() == [[2, 2, 0, 1], [0, 0, 1, 2]]
    # 5 values sorted 0, 1, 2, 3, 4: quantile q sits at position (5 - 1) q, so 0.025 -> 0.1 and 0.975 -> 3.9
    assert percentile_interval([4.0, 0.0, 3.0, 1.0, 2.0]) == pytest.approx([0.1, 3.9], abs=1e-12)
    # one prompt: every resample is that prompt, so the interval is the point: (1 + 0.5 + 0) / 3
    one = win_rate_intervals(["win", "tie", "loss"], [7, 7, 7], [0, 0, 0], n_resamples=50)
    assert one["win_rate_ties_half_ci"] == [0.5, 0.5] and abs(one["lc_win_rate"] - 0.5) < 1e-12


def test_bootstrap_matches_a_naive_loop():
    """The vectorised bootstrap (weights per resample) against the literal procedure: for each resample draw the
    prompts, take all their pairs, compute the win rate and refit the length-controlled one."""
    import numpy as np

    from rlhfkit.eval_stats import lc_win_rate, resample_indices, win_rate_intervals

    rng = random.Random(0)
    groups = [g for g in range(9) for _ in range(rng.randint(1, 4))]  # prompts with 1 to 4 samples
    outcomes = [rng.choice(["win", "win", "tie", "loss"]) for _ in groups]
    diffs = [rng.randint(-6, 6) for _ in groups]
    got = win_rate_intervals(outcomes, groups, diffs, n_resamples=300, seed=11)
    value = {"win": 1.0, "tie": 0.5, "loss": 0.0}
    scale = math.sqrt(sum(d * d for d in diffs) / len(diffs))
    wins, lcs = [], []
    for draw in resample_indices(9, 300, seed=11):
        items = [k for g in draw for k, gk in enumerate(groups) if gk == g]
        wins.append(sum(value[outcomes[k]] for k in items) / len(items))
        lcs.append(lc_win_rate([value[outcomes[k]] for k in items], [diffs[k] for k in items], scale=scale))

    def interval(stats):  # linear interpolation between order statistics, by hand
        s = sorted(stats)
        out = []
        for q in (0.025, 0.975):
            h = (len(s) - 1) * q
            out.append(s[int(h)] + (h - int(h)) * (s[int(h) + 1] - s[int(h)]))
        return out

    assert np.allclose(got["win_rate_ties_half_ci"], interval(wins), atol=1e-12)
    assert np.allclose(got["lc_win_rate_ci"], interval(lcs), atol=1e-7)
    assert got["win_rate_ties_half_ci"][0] < got["win_rate_ties_half_ci"][1]


def test_kl_sums_by_hand():
    from types import SimpleNamespace

    from rlhfkit.eval_models import kl_sums

    # actor log-probs ln 1/2, ln 1/2 and baseline ln 1/4, ln 1/8 on two response tokens; the third is past EOS (masked)
    actor = torch.log(torch.tensor([[0.5, 0.5, 0.9]], dtype=torch.float64))
    base = torch.log(torch.tensor([[0.25, 0.125, 0.1]], dtype=torch.float64))
    rb = SimpleNamespace(action_mask=torch.tensor([[1, 1, 0]]))
    out = kl_sums([actor * rb.action_mask], [base * rb.action_mask], [rb])
    # d = ln(p_base / p_actor) = ln 1/2, ln 1/4; k3 = e^d - d - 1 = (1/2 + ln 2 - 1) + (1/4 + ln 4 - 1); k1 = -d summed = 3 ln 2
    ln2 = math.log(2)
    assert abs(out["k3"][0] - ((0.5 + ln2 - 1) + (0.25 + 2 * ln2 - 1))) < 1e-12
    assert abs(out["k1"][0] - 3 * ln2) < 1e-12
    assert abs(out["logprob_actor"][0] - 2 * math.log(0.5)) < 1e-12 and abs(out["logprob_baseline"][0] - math.log(1 / 32)) < 1e-12


def test_eval_judges_score_both_models(dirs, data, tmp_path, capsys):
    """--judge: each judge scores every response of both models and gets its own numbers; the training reward
    model given again as a judge reproduces the reward's comparison exactly."""
    out = tmp_path / "eval"
    stdout = run(capsys, "--actor", dirs["actor"], "--baseline", dirs["sft"], "--reward_model", dirs["reward"], "--judge",
                 dirs["reward"], "--judge", dirs["judge"], "--prompts", data, "--n", 4, "--n_samples_per_prompt", 3, "--out", out)
    res = check_numbers(out)
    rows, md = res["rows"], (out / "report.md").read_text()
    same, other = res["judges"][str(dirs["reward"])], res["judges"][str(dirs["judge"])]
    assert all(r[m]["judges"][str(dirs["reward"])] == r[m]["reward_model"] for r in rows for m in ("actor", "baseline"))
    assert same["comparison"] == res["comparison"]
    for judge, j in ((str(dirs["reward"]), same), (str(dirs["judge"]), other)):
        def score(r, m):
            return r[m]["judges"][judge]

        check_comparison(j["comparison"], rows, score, [r["judge_outcomes"][judge] for r in rows], 3)
        for m in ("actor", "baseline"):
            mean, _, half = t_interval(per_prompt([score(r, m) for r in rows], 3))
            assert close(j["models"][m]["mean"], mean) and close(j["models"][m]["ci_half_width"], half, 1e-7)
        assert f"| judge {judge} | " in md and f"by the judge {judge}" in stdout
    assert any(r["actor"]["judges"][str(dirs["judge"])] != r["actor"]["reward"] for r in rows)  # another scorer


def test_eval_held_out_prompts_reward_model_plus_gsm8k(dirs, data, tmp_path, capsys, tokenizer):
    out = tmp_path / "eval"
    stdout = run(capsys, "--actor", dirs["actor"], "--baseline", dirs["sft"], "--reward_model", dirs["reward"],
                 "--reward_fn", "gsm8k", "--out", out)
    res = check_numbers(out)
    # the held-out step-3 prompts: exactly the eval rows step 3 held out (neither model trained on them)
    from rlhfkit.data import load_phase_data

    _, held, _ = load_phase_data([str(data)], phase=3, need="prompts", data_split="0,0,1", seed=7, eval_fraction=0.5, max_eval=5)
    assert [r["row"] for r in res["rows"] if r["sample"] == 0] == [ex.meta["row"] for ex in held] and len(held) == 5
    assert res["prompts"]["samples_per_prompt"] == 4 and len(res["rows"]) == 20  # sampled, 4 per prompt by default
    for r in res["rows"]:  # the gsm8k component is the rule on the decoded response and the row's answer
        gold = {"answer": MATH[r["row"]]["answer"]}
        for name in ("actor", "baseline"):
            assert r[name]["reward_fn"] == gsm8k_reward([""], [r[name]["response"]], [gold])[0]
    rm = [r["actor"]["reward_model"] for r in res["rows"]]
    assert statistics.pstdev(rm) > 0  # the random score head gives non-trivial numbers
    assert res["kl"]["per_token"] != 0 and any(not r["same_response"] for r in res["rows"])
    for png in ("reward_hist.png", "reward_vs_length.png", "reward_pairs.png"):
        check_png(out / png)
        assert f"]({png})" in (out / "report.md").read_text()
    assert f"report: {out / 'report.md'}" in stdout and "win rate (actor over baseline)" in stdout and "held-out step-3" in stdout


def test_eval_custom_reward_prompts_file(dirs, data, tmp_path, capsys):
    run(capsys, "--actor", dirs["actor"], "--baseline", dirs["sft"], "--reward_fn", "test_eval:length_reward", "--prompts", data,
        "--n", 8, "--seed", 5, "--out", tmp_path)
    res = check_numbers(tmp_path)
    assert "reward_model" not in res["rows"][0]["actor"]
    assert statistics.pstdev(r["actor"]["reward"] for r in res["rows"]) > 0  # non-trivial numbers
    assert all(r[m]["reward"] == float(len(r[m]["response"])) for r in res["rows"] for m in ("actor", "baseline"))
    # --prompts: all of the file's prompts, shuffled with --seed, the first --n
    from rlhfkit.data import load_phase_data

    rows, _, _ = load_phase_data([str(data)], phase=3, need="prompts", data_split="0,0,1", seed=5, eval_fraction=0.0)
    random.Random(5).shuffle(rows)
    assert [r["row"] for r in res["rows"] if r["sample"] == 0] == [ex.meta["row"] for ex in rows[:8]]


def test_eval_same_model_is_kl_zero_all_ties_and_sampling_is_seeded(dirs, data, tmp_path, capsys):
    args = ["--actor", dirs["actor"], "--baseline", dirs["actor"], "--reward_model", dirs["reward"], "--reward_fn",
            "test_eval:length_reward", "--prompts", data, "--n", 5, "--n_samples_per_prompt", 3]
    run(capsys, *args, "--out", tmp_path / "a")
    res = check_numbers(tmp_path / "a")
    assert res["kl"]["per_token"] == 0.0 and res["kl"]["per_sequence"] == 0.0 and res["kl"]["k1"]["per_token"] == 0.0
    c = res["comparison"]  # all 15 pairs tie: half a win each, in every bootstrap resample and at every length
    assert (c["wins"], c["ties"], c["losses"]) == (0, 15, 0) and all(r["same_response"] for r in res["rows"])
    assert c["win_rate_ties_half"] == 0.5 and c["win_rate_ties_half_ci"] == [0.5, 0.5] and c["lc_win_rate"] == 0.5
    assert "sampling at temperature 1" in res["config"]["decoding"]
    # sampled, not greedy: some prompt's 3 samples differ
    assert any(len({r["actor"]["response"] for r in res["rows"][i:i + 3]}) > 1 for i in range(0, 15, 3))
    run(capsys, *args, "--out", tmp_path / "b")
    assert (tmp_path / "a" / "results.json").read_bytes() == (tmp_path / "b" / "results.json").read_bytes()


def test_eval_actor_only_greedy(dirs, data, tmp_path, capsys):
    stdout = run(capsys, "--actor", dirs["actor"], "--reward_model", dirs["reward"], "--prompts", data, "--n", 4, "--greedy",
                 "--out", tmp_path)
    res = check_numbers(tmp_path, names=("actor",))
    assert res["prompts"]["samples_per_prompt"] == 1 and len(res["rows"]) == 4 and res["config"]["decoding"].startswith("greedy")
    assert "comparison" not in res and "kl" not in res and not (tmp_path / "reward_pairs.png").exists()
    check_png(tmp_path / "reward_hist.png")
    assert "win rate" not in stdout and "| actor |" in (tmp_path / "report.md").read_text()


def test_eval_errors(dirs, data, tmp_path, capsys):
    def err(cls, *args, **kw):
        opts = EvalOptions(**{"actor": str(dirs["actor"]), "reward_model": str(dirs["reward"]), "out": str(tmp_path / "e"),
                              "prompts": [str(data)], "n": 2, "max_new_tokens": 2, "device": "cpu", **kw})
        with pytest.raises(cls) as e:
            run_eval(opts, echo=False)
        return str(e.value)

    assert "--actor" in err(CheckpointError, actor=str(dirs["reward"])) and "'reward'" in err(CheckpointError, actor=str(dirs["reward"]))
    assert "--reward_model" in err(CheckpointError, reward_model=str(dirs["sft"]))
    assert "--baseline" in err(CheckpointError, baseline=str(dirs["reward"]))
    assert "no reward" in err(ConfigError, reward_model=None)
    assert "--n_samples_per_prompt must be >= 1" in err(ConfigError, n_samples_per_prompt=0)
    assert "--judge" in err(CheckpointError, judges=[str(dirs["sft"])]) and "'sft'" in err(CheckpointError, judges=[str(dirs["sft"])])
    assert "given twice" in err(ConfigError, judges=[str(dirs["reward"])] * 2)
    assert "pass --prompts" in err(ConfigError, actor=str(dirs["sft"]), prompts=[])
    assert "module.path:function" in err(ConfigError, reward_fn="nonsense")
    # a reward model trained with another tokenizer
    import shutil

    other = tmp_path / "other_rm"
    shutil.copytree(dirs["reward"], other)
    manifest = json.loads((other / "rlhfkit.json").read_text())
    manifest["tokenizer_sha256"] = "0" * 64
    (other / "rlhfkit.json").write_text(json.dumps(manifest))
    assert "tokenizer mismatch" in err(CheckpointError, reward_model=str(other))
    # through the CLI: one line, exit status 2, no traceback
    with pytest.raises(SystemExit) as e:
        main(["eval", "--actor", str(dirs["actor"]), "--out", str(tmp_path / "x")])
    assert e.value.code == 2
    msg = capsys.readouterr().err
    assert msg.startswith("error: no reward") and "Traceback" not in msg
    with pytest.raises(SystemExit) as e:  # a removed flag: one line saying what to do instead
        main(["eval", "--actor", str(dirs["actor"]), "--reward_fn", "gsm8k", "--temperature", "0.7", "--out", str(tmp_path / "t")])
    assert e.value.code == 2 and "removed; evaluation samples at temperature 1" in capsys.readouterr().err
    assert issubclass(CheckpointError, RlhfkitError)


def test_eval_applies_step3_prompt_suffix(dirs, data, tmp_path, capsys, tokenizer):
    """An actor trained with --prompt_suffix is evaluated on its held-out prompts with the same instruction."""
    import shutil

    from rlhfkit.checkpoint import read_manifest, write_manifest

    actor = tmp_path / "actor_suffix"
    shutil.copytree(dirs["actor"], actor)
    manifest = read_manifest(actor)
    manifest["config"]["prompt_suffix"] = "Answer after '####'."
    write_manifest(actor, manifest)
    out = tmp_path / "eval"
    stdout = run(capsys, "--actor", actor, "--reward_fn", "gsm8k", "--out", out)
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert rows and all(r["prompt"].endswith("Answer after '####'.") for r in rows), [r["prompt"] for r in rows]
    assert "--prompt_suffix" in stdout or "--prompt_suffix" in (out / "report.md").read_text()
