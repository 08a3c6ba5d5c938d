"""Data for the three steps: read sources, split them by phase, tokenise, collate.

    train, eval, reports = load_phase_data(args.data_path, phase=1, need="sft",
                                           data_split=args.data_split, seed=args.seed)
    features, tok_report = tokenize_sft(train, tokenizer, args.max_seq_len)
    batch = collate_sft(features[:4], tokenizer.pad_token_id)

The tokenisation and collation parts import torch / a tokenizer only when used.
"""

from rlhfkit.data.formats import Example, parse_dialogue, with_prompt_suffix
from rlhfkit.data.load import SourceReport, load_phase_data, load_ptx_rows
from rlhfkit.data.sources import FORMATS_HELP, read_source
from rlhfkit.data.splits import cut_eval, parse_data_split, phase_rows
from rlhfkit.data.tokenize import (
    IGNORE_INDEX,
    TokenizeReport,
    encode_prompt,
    encode_response,
    tokenize_by_source,
    tokenize_kto,
    tokenize_pairs,
    tokenize_prompts,
    tokenize_sft,
)


def __getattr__(name):  # collators need torch; import them on first use
    if name in ("collate_sft", "collate_pairs", "collate_packed_pairs", "collate_prompts", "collate_kto"):
        from rlhfkit.data import collate

        return getattr(collate, name)
    raise AttributeError(f"module 'rlhfkit.data' has no attribute {name!r}")


__all__ = [
    "Example", "SourceReport", "TokenizeReport", "load_phase_data", "load_ptx_rows", "read_source", "parse_dialogue",
    "parse_data_split", "phase_rows", "cut_eval", "encode_prompt", "encode_response",
    "tokenize_sft", "tokenize_pairs", "tokenize_by_source", "tokenize_prompts", "tokenize_kto", "collate_sft", "collate_pairs",
    "collate_packed_pairs", "collate_prompts", "collate_kto", "IGNORE_INDEX", "FORMATS_HELP", "with_prompt_suffix",
]
