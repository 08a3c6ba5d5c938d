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
    """actor (stage 'actor', trained on `data` by the manifest), sft (a perturbed copy), reward (random score head)."""
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
    torch.manual_seed(3)
    rm = load_model(str(tiny_dir), "reward", dtype="fp32", pad_token_id=tokenizer.pad_token_id)
    rm.score.weight.data.normal_(0, 1.0)
    out["reward"] = _save(rm, tokenizer, root / "reward", "reward")
    return out


def run(capsys, *args):
    main(["eval", "--max_new_tokens", str(TOKENS), "--batch_size", "4", "--dtype", "fp32", "--device", "cpu", *map(str, args)])
    return capsys.readouterr().out


def close(a, b, tol=1e-9):
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b))


def check_numbers(out_dir, names=("actor", "baseline")):
    """Recompute every headline number from results.json's rows; check report.md shows them."""
    res = json.loads((out_dir / "results.json").read_text())
    rows, md = res["rows"], (out_dir / "report.md").read_text()
    n = len(rows)
    assert res["prompts"]["count"] == n and [r["index"] for r in rows] == list(range(n))
    for name in names:
        m, rewards = res["models"][name], [r[name]["reward"] for r in rows]
        for r in rows:  # the total is the sum of the components that exist
            comps = [r[name][k] for k in ("reward_model", "reward_fn") if k in r[name]]
            assert comps and close(r[name]["reward"], sum(comps))
        mean, sd = statistics.fmean(rewards), statistics.stdev(rewards)
        half = T975[n - 1] * sd / math.sqrt(n)
        assert close(m["reward"]["mean"], mean) and close(m["reward"]["std"], sd) and close(m["reward"]["ci_half_width"], half, 1e-7)
        assert close(m["reward"]["ci_low"], mean - half, 1e-7) and close(m["reward"]["ci_high"], mean + half, 1e-7)
        assert close(m["response_tokens_mean"], statistics.fmean(r[name]["tokens"] for r in rows))
        assert close(m["truncated_rate"], sum(r[name]["truncated"] for r in rows) / n)
        assert all(1 <= r[name]["tokens"] <= TOKENS for r in rows)
        assert all(r[name]["tokens"] == TOKENS for r in rows if r[name]["truncated"])
        assert f"| {name} | {fmt(mean)} ± {fmt(half)} [{fmt(mean - half)}, {fmt(mean + half)}] | " in md
    if "baseline" in names:
        c, kl = res["comparison"], res["kl"]
        outcomes = []
        for r in rows:
            a, b = r["actor"]["reward"], r["baseline"]["reward"]
            if r["same_response"]:
                assert r["actor"]["response"] == r["baseline"]["response"] and r["actor"]["tokens"] == r["baseline"]["tokens"]
            outcomes.append("tie" if r["same_response"] or abs(a - b) <= 1e-6 else "win" if a > b else "loss")
            assert close(r["kl"], r["logprob_actor"] - r["logprob_baseline"])
        assert [r["outcome"] for r in rows] == outcomes
        w, t, lo = (outcomes.count(k) for k in ("win", "tie", "loss"))
        assert (c["wins"], c["ties"], c["losses"]) == (w, t, lo) and w + t + lo == n
        assert close(c["win_rate"], w / n) and close(c["win_rate_ties_half"], (w + t / 2) / n)
        assert f"| {w} | {t} | {lo} | {fmt(w / n)} | {fmt((w + t / 2) / n)} |" in md
        kl_sum, toks = math.fsum(r["kl"] for r in rows), sum(r["actor"]["tokens"] for r in rows)
        assert kl["tokens"] == toks and close(kl["per_token"], kl_sum / toks) and close(kl["per_sequence"], kl_sum / n)
        assert f"per token: {fmt(kl_sum / toks)}" in md and f"per sequence: {fmt(kl_sum / n)}" in md
        diffs = [r["actor"]["reward"] - r["baseline"]["reward"] for r in rows]
        assert close(c["reward_difference"]["mean"], statistics.fmean(diffs))
    assert "## Examples" in md and "Student t" in md
    return res


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


def test_eval_held_out_prompts_reward_model_plus_gsm8k(dirs, data, tmp_path, capsys, tokenizer):
    out = tmp_path / "eval"
    stdout = run(capsys, "--actor", dirs["actor"], "--baseline", dirs["sft"], "--reward_model", dirs["reward"],
                 "--reward_fn", "gsm8k", "--out", out)
    res = check_numbers(out)
    # the held-out step-3 prompts: exactly the eval rows step 3 held out (neither model trained on them)
    from rlhfkit.data import load_phase_data

    _, held, _ = load_phase_data([str(data)], phase=3, need="prompts", data_split="0,0,1", seed=7, eval_fraction=0.5, max_eval=5)
    assert [r["row"] for r in res["rows"]] == [ex.meta["row"] for ex in held] and len(held) == 5
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
    assert [r["row"] for r in res["rows"]] == [ex.meta["row"] for ex in rows[:8]]


def test_eval_same_model_is_kl_zero_all_ties_and_sampling_is_seeded(dirs, data, tmp_path, capsys):
    args = ["--actor", dirs["actor"], "--baseline", dirs["actor"], "--reward_model", dirs["reward"], "--reward_fn",
            "test_eval:length_reward", "--prompts", data, "--n", 5, "--temperature", "1.0"]
    run(capsys, *args, "--out", tmp_path / "a")
    res = check_numbers(tmp_path / "a")
    assert res["kl"]["per_token"] == 0.0 and res["kl"]["per_sequence"] == 0.0
    c = res["comparison"]
    assert (c["wins"], c["ties"], c["losses"]) == (0, 5, 0) and all(r["same_response"] for r in res["rows"])
    assert "sampling" in res["config"]["decoding"]
    run(capsys, *args, "--out", tmp_path / "b")
    assert (tmp_path / "a" / "results.json").read_bytes() == (tmp_path / "b" / "results.json").read_bytes()


def test_eval_actor_only(dirs, data, tmp_path, capsys):
    stdout = run(capsys, "--actor", dirs["actor"], "--reward_model", dirs["reward"], "--prompts", data, "--n", 4, "--out", tmp_path)
    res = check_numbers(tmp_path, names=("actor",))
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
    assert "--greedy" in err(ConfigError, greedy=True, temperature=0.7)
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
