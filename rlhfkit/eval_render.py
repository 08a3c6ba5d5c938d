"""How ``rlhfkit eval`` shows its results: the PNG plots, report.md and the headline printed at the end.
Everything here reads the results dict (results.json) and nothing else."""

from __future__ import annotations

import math
from pathlib import Path

from rlhfkit.eval_stats import CI_LEVEL
from rlhfkit.rendering import fence, fmt, label_axes, md_escape, png_figure

COLORS = {"actor": "#1f77b4", "baseline": "#ff7f0e"}
OUTCOME_COLORS = {"win": "#2ca02c", "tie": "#7f7f7f", "loss": "#d62728"}
EXAMPLE_CHARS = 1200  # longest prompt / response text shown in report.md


# ----------------------------------------------------------------------------------------------
# plots


def write_plots(results: dict, out: Path) -> list[tuple[str, str]]:
    """(title, file) of each PNG written into ``out``."""
    import numpy as np

    rows, names = results["rows"], list(results["models"])
    rewards = {n: np.array([r[n]["reward"] for r in rows], dtype=float) for n in names}
    plots = [plot_reward_hist(rewards, len(rows), out / "reward_hist.png"),
             plot_reward_vs_length(rows, rewards, out / "reward_vs_length.png")]
    if "baseline" in names:
        plots.append(plot_reward_pairs(rows, rewards, out / "reward_pairs.png"))
    return plots


def plot_reward_hist(rewards: dict, n_responses: int, path: Path) -> tuple[str, str]:
    """Each model's rewards as a histogram on shared bins, its mean as a dashed line."""
    import numpy as np

    with png_figure(path) as ax:
        both = np.concatenate(list(rewards.values()))
        lo, hi = float(both.min()), float(both.max())
        if hi - lo < 1e-9:
            lo, hi = lo - 0.5, hi + 0.5
        edges = np.linspace(lo, hi, min(30, max(6, int(math.sqrt(len(both))) + 1)) + 1)
        for n, r in rewards.items():
            ax.hist(r, bins=edges, alpha=0.5, color=COLORS[n], edgecolor=COLORS[n], label=f"{n} (mean {r.mean():.4g})")
            ax.axvline(r.mean(), color=COLORS[n], linestyle="--", linewidth=1.5)
        label_axes(ax, f"Reward distribution ({n_responses} responses per model)", "reward", "responses")
    return "Reward distribution", path.name


def plot_reward_vs_length(rows: list[dict], rewards: dict, path: Path) -> tuple[str, str]:
    with png_figure(path) as ax:
        for n, r in rewards.items():
            tokens = [row[n]["tokens"] for row in rows]
            ax.scatter(tokens, r, s=18, alpha=0.7, color=COLORS[n], label=n, marker="o" if n == "actor" else "^")
        label_axes(ax, "Reward vs response length", "response tokens", "reward")
    return "Reward vs response length", path.name


def plot_reward_pairs(rows: list[dict], rewards: dict, path: Path) -> tuple[str, str]:
    """Actor against baseline reward, one point per pair (prompt and sample) coloured by its outcome, and the diagonal."""
    import numpy as np

    with png_figure(path, figsize=(5, 5)) as ax:
        for kind, color in OUTCOME_COLORS.items():
            pts = [(r["baseline"]["reward"], r["actor"]["reward"]) for r in rows if r["outcome"] == kind]
            if pts:
                xs, ys = zip(*pts)
                ax.scatter(xs, ys, s=18, alpha=0.8, color=color, label=f"{kind} ({len(pts)})")
        both = np.concatenate([rewards["actor"], rewards["baseline"]])
        lo, hi = float(both.min()), float(both.max())
        pad = max(hi - lo, 1.0) * 0.05
        ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="black", linewidth=0.8, linestyle=":")
        label_axes(ax, "Reward per pair: actor vs baseline", "baseline reward", "actor reward")
    return "Reward per pair: actor vs baseline", path.name


# ----------------------------------------------------------------------------------------------
# text


def _reward_cell(stats: dict) -> str:
    if stats["ci_half_width"] is None:
        return f"{fmt(stats['mean'])} (n = {stats['n']}, no interval)"
    return f"{fmt(stats['mean'])} ± {fmt(stats['ci_half_width'])} [{fmt(stats['ci_low'])}, {fmt(stats['ci_high'])}]"


def _rate_cell(rate: float | None, ci: list | None) -> str:
    return fmt(rate) + (f" [{fmt(ci[0])}, {fmt(ci[1])}]" if ci else "")


def headline_rows(results: dict) -> list[tuple[str, str, str, str, str]]:
    return [(name, _reward_cell(m["reward"]), fmt(m["response_tokens_mean"]), f"{100 * m['truncated_rate']:.1f}%",
             f"{100 * m.get('empty_rate', 0.0):.1f}%") for name, m in results["models"].items()]


def scorer_comparisons(results: dict) -> list[tuple[str, dict]]:
    """(scorer, actor-vs-baseline statistics): the reward first, then each judge."""
    if "comparison" not in results:
        return []
    return [("reward", results["comparison"])] + [(f"judge {j}", v["comparison"]) for j, v in results.get("judges", {}).items()]


def kl_line(kl: dict) -> str:
    return (f"{fmt(kl['per_token'])} nats per token, {fmt(kl['per_sequence'])} per sequence (k3 on the actor's "
            f"{kl['tokens']} response tokens; k1: {fmt(kl['k1']['per_token'])} per token, {fmt(kl['k1']['per_sequence'])} per sequence)")


def comparison_lines(results: dict) -> list[str]:
    lines = [f"judge {j} mean score: " + ", ".join(f"{name} {_reward_cell(ci)}" for name, ci in v["models"].items())
             for j, v in results.get("judges", {}).items()]
    if "comparison" not in results:
        return lines
    p = results["prompts"]
    for scorer, c in scorer_comparisons(results):
        lines += [f"win rate (actor over baseline) by the {scorer}, ties as half: "
                  f"{_rate_cell(c['win_rate_ties_half'], c['win_rate_ties_half_ci'])}, length-controlled "
                  f"{_rate_cell(c['lc_win_rate'], c['lc_win_rate_ci'])} — wins {c['wins']}, ties {c['ties']}, losses "
                  f"{c['losses']} of {p['responses']} pairs ({p['count']} prompts x {p['samples_per_prompt']})",
                  f"  {scorer} difference (actor - baseline, paired): {_reward_cell(c['reward_difference'])}"]
    return lines + [f"KL(actor || baseline): {kl_line(results['kl'])}"]


def headline_text(results: dict) -> str:
    """The headline table and the comparison, as printed at the end of the run."""
    header = ("model", f"mean reward ± {int(CI_LEVEL * 100)}% CI", "length (tokens)", "truncated", "empty")
    table = [header] + headline_rows(results)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + comparison_lines(results))


def build_markdown(results: dict, plots: list[tuple[str, str]]) -> str:
    """report.md: the settings, the headline table, actor vs baseline, the plots and example pairs."""
    cfg = results["config"]
    lines = ["# rlhfkit evaluation", ""]
    lines += [f"- actor: `{results['models']['actor']['path']}`"]
    if "baseline" in results["models"]:
        lines += [f"- baseline: `{results['models']['baseline']['path']}`"]
    reward = " + ".join(x for x in (f"reward model `{cfg['reward_model']}`" if cfg["reward_model"] else "",
                                    f"reward function `{cfg['reward_fn']}`" if cfg["reward_fn"] else "") if x)
    lines += [f"- reward: {reward}",
              f"- prompts: {results['prompts']['count']}, {results['prompts']['samples_per_prompt']} response(s) each per model; "
              f"{md_escape(results['prompts']['origin'])}",
              f"- decoding: {cfg['decoding']}, up to {cfg['max_new_tokens']} new tokens; {cfg['device']}, {cfg['dtype']}",
              "", "| Model | Mean reward ± 95% CI | Response length (tokens) | Truncated | Empty |",
              "|---|---:|---:|---:|---:|"]
    lines += ["| " + " | ".join(row) + " |" for row in headline_rows(results)]
    lines.append("")
    for name in results["models"]:
        extra = [f"{k} {fmt(v)}" for k, v in results["models"][name].items() if k in ("reward_model_mean", "reward_fn_mean")]
        if len(extra) == 2:
            lines.append(f"- {name} reward components (means): {', '.join(extra)}")
    lines += _comparison_markdown(results)
    st = results["statistics"]
    lines += ["", f"Confidence intervals: {st['confidence_interval']}. Ties: {st['tie']}."]
    if "comparison" in results:
        lines += [f"Pairs: {st['pairs']}. Win-rate intervals: {st['win_rate_interval']}. Length control: {st['length_controlled']}.",
                  f"KL: {st['kl']}."]
    lines += ["", "## Plots", ""] + [f"![{t}]({f})\n" for t, f in plots]
    lines += ["## Examples", ""] + _examples_markdown(results)
    lines += ["", "One row per prompt and sample, every number and the settings: `results.json`."]
    return "\n".join(lines)


def _comparison_markdown(results: dict) -> list[str]:
    lines = []
    if results.get("judges"):
        names = list(results["models"])
        lines += ["", "## Judges", "", "| Judge | " + " | ".join(f"{n} mean score ± 95% CI" for n in names) + " |",
                  "|---|" + "---:|" * len(names)]
        lines += [f"| `{md_escape(j)}` | " + " | ".join(_reward_cell(v["models"][n]) for n in names) + " |"
                  for j, v in results["judges"].items()]
    if "comparison" not in results:
        return lines
    lines += ["", "## Actor vs baseline", "",
              "| Scorer | Wins | Ties | Losses | Win rate (ties as half) [95% CI] | Length-controlled win rate [95% CI] | "
              "Score difference (actor - baseline) ± 95% CI |", "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {md_escape(scorer)} | {c['wins']} | {c['ties']} | {c['losses']} | "
              f"{_rate_cell(c['win_rate_ties_half'], c['win_rate_ties_half_ci'])} | {_rate_cell(c['lc_win_rate'], c['lc_win_rate_ci'])} | "
              f"{_reward_cell(c['reward_difference'])} |" for scorer, c in scorer_comparisons(results)]
    kl = results["kl"]
    return lines + ["", f"- KL(actor ‖ baseline) per token (k3): {fmt(kl['per_token'])}",
                    f"- KL(actor ‖ baseline) per sequence (k3): {fmt(kl['per_sequence'])} ± "
                    f"{fmt(kl['per_sequence_ci']['ci_half_width'])} (95% CI over prompts; {kl['tokens']} actor response tokens)",
                    f"- k1 (log-ratio) per token: {fmt(kl['k1']['per_token'])}, per sequence: {fmt(kl['k1']['per_sequence'])}"]


def _examples_markdown(results: dict) -> list[str]:
    lines: list[str] = []
    by_index = {r["index"]: r for r in results["rows"]}
    for ex in results["examples"]:
        r = by_index[ex["index"]]
        lines += [f"### Prompt {r['prompt_index']}, sample {r['sample']} ({ex['why']})", "", fence(r["prompt"], EXAMPLE_CHARS), ""]
        for name in results["models"]:
            m = r[name]
            comps = [f"{k} {fmt(m[k])}" for k in ("reward_model", "reward_fn") if k in m]
            lines += [f"**{name}** — reward {fmt(m['reward'])}" + (f" ({', '.join(comps)})" if len(comps) == 2 else "")
                      + f", {m['tokens']} tokens{', truncated' if m['truncated'] else ''}", "", fence(m["response"], EXAMPLE_CHARS), ""]
        if "outcome" in r:
            lines += [f"Outcome: actor {r['outcome']}; log p_actor - log p_baseline = {fmt(r['kl_k1'])}, k3 = {fmt(r['kl_k3'])}", ""]
    return lines
