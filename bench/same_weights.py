"""Behaviour-equality check for a refactor: the same weights, flags, defaults and configs as a git revision.

    python bench/same_weights.py --against 5f6227d [--current DIR] [--work DIR] [--out same_weights.json]

Runs tiny fp32 trainings at the same seed in REV's tree (a git worktree, bench/revisions.py) and in the
current one, 2 ranks under ZeRO-3, on a tiny random Llama (2 layers, hidden 64, SmolLM2's tokenizer from
the embedded GGUF, built like tests/conftest.py's `tiny_dir`):
  - sft:    step 1 on ../shared/data/hh-rlhf-harmless-base (the chosen responses);
  - reward: step 2's reward model on the same pairs;
  - dpo:    step 2's DPO from REV's sft output;
  - ppo:    step 3 PPO, actor = REV's sft output, critic = REV's reward output;
  - grpo:   step 3 GRPO with packed groups (4 samples a prompt) on ../shared/data/gsm8k, rewarded by the
            gsm8k rule plus REV's reward model (the rule alone gives a random model all zeros, so nothing
            would train).
Both trees start step 2's DPO and step 3 from the same (REV's) checkpoints, so a difference shows in the
program that makes it. Then it compares:
  - every output model.safetensors tensor, bit for bit (torch.equal; the largest |difference| if not), and
    whether the run moved the weights at all (an untrained output would make "identical" vacuous);
  - every program's options (step 1, 2, DPO, 3 and step2_reward/evaluate.py): flag strings, defaults,
    types, nargs, choices, read from the parser each program builds (what its --help prints; the help
    wording may differ and is only counted);
  - the "config" dict of every output's rlhfkit.json manifest: same keys, same values once the locations
    of the tree, of the run's output and of the common inputs are written as placeholders.
Ends with one verdict line; the exit status is 1 when anything differs. A check tool, not a test.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from revisions import PROGRAMS, REPO, Tree, current_tree, programs_options, revision_tree, run_program, tree_env

DATA = (REPO / ".." / "shared" / "data").resolve()
HH = DATA / "hh-rlhf-harmless-base" / "pairs.jsonl.gz"
GSM8K = DATA / "gsm8k" / "test_first1000.jsonl"
COMMON = ["--dtype", "fp32", "--seed", "1234", "--progress_bar", "false"]
SUPERVISED = [*COMMON, "--zero_stage", "3", "--max_seq_len", "128", "--per_device_train_batch_size", "2",
              "--learning_rate", "1e-3", "--lr_scheduler_type", "constant", "--eval_fraction", "0.02",
              "--max_eval_samples", "4", "--max_steps", "3"]
STEP3 = [*COMMON, "--actor_zero_stage", "3", "--critic_zero_stage", "3", "--data_split", "0,0,1", "--eval_fraction", "0.01",
         "--max_eval_samples", "2", "--max_answer_seq_len", "16", "--max_steps", "2",
         "--actor_learning_rate", "1e-3", "--critic_learning_rate", "1e-3"]

# Run inside REV's tree: the tiny random Llama of tests/conftest.py's `tiny_dir`, written to argv[1].
_TINY = r"""
import os, sys, torch
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM
from rlhfkit.models import ensure_distinct_pad
from rlhfkit.models.base import default_gguf
directory, name = os.path.split(default_gguf())
tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
ensure_distinct_pad(tok)
torch.manual_seed(0)
config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
LlamaForCausalLM(config).save_pretrained(sys.argv[1], safe_serialization=True)
tok.save_pretrained(sys.argv[1])
GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id).save_pretrained(sys.argv[1])
"""


@dataclass(frozen=True)
class Stage:
    """One tiny training: its program, its arguments, and the checkpoint each output started from."""
    name: str
    script: str
    args: tuple[str, ...]
    starts: tuple[tuple[str, str], ...]  # (output sub-directory, input checkpoint) pairs


def stages(tiny: Path, rev_out: Path) -> list[Stage]:
    """The five tiny runs; dpo, ppo and grpo start from REV's sft (and reward) outputs."""
    sft, reward = str(rev_out / "sft"), str(rev_out / "reward")
    return [
        Stage("sft", "step1_sft/main.py", (*SUPERVISED, "--model_name_or_path", str(tiny), "--data_path", str(HH),
                                           "--data_split", "1,0,0"), ((".", str(tiny)),)),
        Stage("reward", "step2_reward/main.py", (*SUPERVISED, "--model_name_or_path", str(tiny), "--data_path", str(HH),
                                                 "--data_split", "0,1,0"), ((".", str(tiny)),)),
        Stage("dpo", "step2_dpo/main.py", (*SUPERVISED, "--model_name_or_path", sft, "--data_path", str(HH),
                                           "--data_split", "0,1,0"), ((".", sft),)),
        Stage("ppo", "step3_ppo/main.py", (*STEP3, "--actor_model_name_or_path", sft, "--critic_model_name_or_path", reward,
                                           "--data_path", str(HH), "--max_prompt_seq_len", "64",
                                           "--per_device_generation_batch_size", "2", "--per_device_training_batch_size", "2"),
              (("actor", sft), ("critic", reward))),
        Stage("grpo", "step3_ppo/main.py", (*STEP3, "--algo", "grpo", "--n_samples_per_prompt", "4", "--pack_groups", "true",
                                            "--kl_estimator", "k3", "--reward_fn", "gsm8k", "--reward_model_name_or_path", reward,
                                            "--actor_model_name_or_path", sft, "--data_path", str(GSM8K),
                                            "--max_prompt_seq_len", "256", "--per_device_generation_batch_size", "1",
                                            "--per_device_training_batch_size", "4"),
              (("actor", sft),)),
    ]


def run_side(tree: Tree, stage_list: list[Stage], out: Path, reuse: bool = False) -> None:
    """Run every stage in ``tree``; with ``reuse``, a stage whose output is complete (has its manifest) is kept."""
    for stage in stage_list:
        if reuse and all((out / stage.name / sub / "rlhfkit.json").exists() for sub, _ in stage.starts):
            print(f"[{tree.name}] {stage.name}: kept from an earlier run", flush=True)
            continue
        if reuse and (out / stage.name).exists():
            shutil.rmtree(out / stage.name)  # an incomplete earlier run of REV's code
        if (out / stage.name).exists():
            raise SystemExit(f"{out / stage.name} exists: pass an empty --work directory (or --reuse_rev for REV's outputs)")
        print(f"[{tree.name}] {stage.name}: {stage.script}", flush=True)
        run_program(tree, stage.script, [*stage.args, "--output_dir", str(out / stage.name)], nprocs=2,
                    env=tree_env(tree, threads=1), timeout=1800)


def load(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def compare_weights(rev_dir: Path, cur_dir: Path) -> dict:
    """Every model.safetensors under the two output directories, tensor by tensor."""
    import torch

    files = sorted({p.relative_to(d) for d in (rev_dir, cur_dir) for p in d.rglob("model.safetensors")})
    out = {}
    for rel in files:
        if not (rev_dir / rel).exists() or not (cur_dir / rel).exists():
            out[str(rel)] = {"identical": False, "note": "missing on one side"}
            continue
        a, b = load(rev_dir / rel), load(cur_dir / rel)
        diffs = {k: (a[k].double() - b[k].double()).abs().max().item() if a[k].shape == b[k].shape else float("inf")
                 for k in set(a) & set(b) if not torch.equal(a[k], b[k])}
        same_keys = set(a) == set(b)
        out[str(rel)] = {"identical": same_keys and not diffs, "tensors": len(a), "tensors_differing": len(diffs),
                         "max_abs_diff": max(diffs.values(), default=0.0),
                         "note": "" if same_keys else f"tensor names differ: {sorted(set(a) ^ set(b))[:5]}"}
    return out


def moved(output: Path, start: str) -> bool:
    """Whether any tensor the output shares with its starting checkpoint changed."""
    import torch

    a, b = load(output / "model.safetensors"), load(Path(start) / "model.safetensors")
    return any(not torch.equal(a[k], b[k]) for k in set(a) & set(b))


def normalize(value, places: list[tuple[str, str]]):
    """``value`` with every location in ``places`` ((path, placeholder) pairs, in turn) written as its placeholder."""
    if isinstance(value, str):
        for path, name in places:
            value = value.replace(path, name)
        return value
    if isinstance(value, list):
        return [normalize(v, places) for v in value]
    if isinstance(value, dict):
        return {k: normalize(v, places) for k, v in value.items()}
    return value


def compare_configs(trees: list[Tree], outs: list[Path]) -> dict:
    """The manifests' "config" dicts of every output, side by side: keys and values that differ. Locations are
    written as placeholders first: the run's own output directory, REV's outputs (both sides' common inputs),
    the side's output root, its tree."""
    manifests = [{str(p.parent.relative_to(o)): p for p in o.rglob("rlhfkit.json")} for o in outs]
    result = {}
    for rel in sorted(set(manifests[0]) | set(manifests[1])):
        if rel not in manifests[0] or rel not in manifests[1]:
            result[rel] = {"same": False, "note": "manifest missing on one side"}
            continue
        configs = []
        for tree, out, found in zip(trees, outs, manifests, strict=True):
            config = json.loads(found[rel].read_text())["config"]
            places = [(str(out / Path(rel).parts[0]), "<output>"), (str(outs[0]), "<rev-out>"), (str(out), "<out>"),
                      (str(tree.root), "<tree>")]
            configs.append(normalize(config, places))
        a, b = configs
        keys = sorted(set(a) ^ set(b))
        values = {k: [a[k], b[k]] for k in sorted(set(a) & set(b)) if a[k] != b[k]}
        result[rel] = {"same": not keys and not values, "keys_on_one_side": keys, "values_differing": values,
                       "keys": len(a)}
    return result


def compare_options(trees: list[Tree]) -> dict:
    """Each program's options in both trees: flags, defaults and the rest of each option's spec."""
    found = [programs_options(t, PROGRAMS) for t in trees]
    result = {}
    for script in PROGRAMS:
        (a, help_a), (b, help_b) = ((f[script]["options"], f[script]["help"]) for f in found)
        only = {trees[0].name: sorted(set(a) - set(b)), trees[1].name: sorted(set(b) - set(a))}
        changed = {dest: {k: [a[dest][k], b[dest].get(k)] for k in a[dest] if a[dest][k] != b[dest].get(k)}
                   for dest in sorted(set(a) & set(b)) if a[dest] != b[dest]}
        help_lines = len(set(help_a.splitlines()) ^ set(help_b.splitlines()))
        result[script] = {"same": not any(only.values()) and not changed, "only_in": only, "changed": changed,
                          "options": len(a), "help_lines_differing": help_lines}
    return result


def print_tables(weights: dict, trained: dict, options: dict, configs: dict, rev: str) -> None:
    print(f"\nweights, current vs {rev} (torch.equal on every tensor):")
    print(f"{'output':<32}{'identical':>10}{'tensors':>9}{'differ':>8}{'max |diff|':>13}{'trained':>9}")
    for rel, w in weights.items():
        print(f"{rel:<32}{'yes' if w['identical'] else 'NO':>10}{w.get('tensors', 0):>9}{w.get('tensors_differing', 0):>8}"
              f"{w.get('max_abs_diff', float('nan')):>13.3g}{trained.get(rel, '-'):>9}  {w.get('note', '')}")
    print(f"\noptions (flags, defaults, types), current vs {rev}:")
    print(f"{'program':<28}{'options':>8}{'same':>6}{'help lines differing':>22}")
    for script, o in options.items():
        print(f"{script:<28}{o['options']:>8}{'yes' if o['same'] else 'NO':>6}{o['help_lines_differing']:>22}")
        for side, dests in o["only_in"].items():
            if dests:
                print(f"    only in {side}: {', '.join('--' + d for d in dests)}")
        for dest, fields in o["changed"].items():
            print(f"    --{dest}: " + "; ".join(f"{k} {v[0]!r} ({rev}) -> {v[1]!r} (current)" for k, v in fields.items()))
    print(f"\nmanifest config dicts, current vs {rev}:")
    print(f"{'output':<20}{'keys':>6}{'same':>6}")
    for rel, c in configs.items():
        print(f"{rel:<20}{c.get('keys', 0):>6}{'yes' if c['same'] else 'NO':>6}  {c.get('note', '')}")
        if c.get("keys_on_one_side"):
            print(f"    keys on one side only: {', '.join(c['keys_on_one_side'])}")
        for k, (va, vb) in c.get("values_differing", {}).items():
            print(f"    {k}: {va!r} ({rev}) -> {vb!r} (current)")


def trained_table(stage_list: list[Stage], out: Path) -> dict:
    """output file -> "yes"/"NO": whether the current tree's run moved the weights it started from."""
    table = {}
    for stage in stage_list:
        for sub, start in stage.starts:
            rel = str(Path(stage.name) / sub / "model.safetensors")
            path = out / stage.name / sub
            table[rel] = ("yes" if moved(path, start) else "NO") if (path / "model.safetensors").exists() else "-"
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", required=True, metavar="REV", help="the git revision to compare with (run from a worktree)")
    ap.add_argument("--current", metavar="DIR", help="the checkout that runs as 'current' (default: this one)")
    ap.add_argument("--work", metavar="DIR", help="keep the outputs here (default: a temporary directory, removed)")
    ap.add_argument("--reuse_rev", action="store_true", help="keep REV's complete outputs already in --work (REV's code "
                                                                 "is fixed; the current tree always runs again)")
    ap.add_argument("--out", default="same_weights.json", help="where the full comparison is written (JSON)")
    args = ap.parse_args()
    rev, cur = revision_tree(args.against), current_tree(args.current)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp).resolve()
        rev_out, cur_out = work / f"rev-{rev.name}", work / "current"
        tiny = work / "tiny-llama"
        if not (tiny / "config.json").exists():
            subprocess.run([sys.executable, "-c", _TINY, str(tiny)], env=tree_env(rev), cwd=tmp, check=True)
        stage_list = stages(tiny, rev_out)
        options = compare_options([rev, cur])
        run_side(rev, stage_list, rev_out, reuse=args.reuse_rev)
        run_side(cur, stage_list, cur_out)
        weights = compare_weights(rev_out, cur_out)
        trained = trained_table(stage_list, cur_out)
        configs = compare_configs([rev, cur], [rev_out, cur_out])
    print_tables(weights, trained, options, configs, rev.name)
    bad = [f"weights of {k}" for k, w in weights.items() if not w["identical"]]
    bad += [f"options of {k}" for k, o in options.items() if not o["same"]]
    bad += [f"config of {k}" for k, c in configs.items() if not c["same"]]
    untrained = [k for k, t in trained.items() if t != "yes"]
    with open(args.out, "w") as f:
        json.dump({"against": args.against, "rev": rev.name, "current": str(cur.root), "weights": weights, "trained": trained,
                   "options": options, "configs": configs, "differences": bad, "untrained": untrained}, f, indent=2)
    note = f" (untrained, so their equality says little: {', '.join(untrained)})" if untrained else ""
    if bad:
        print(f"\nVERDICT: DIFFERENT from {rev.name}: {', '.join(bad)}{note}")
    else:
        print(f"\nVERDICT: same as {rev.name}: weights bit for bit, flags, defaults and config dicts{note}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
