"""One rank, a ZeRO-3 engine (its parameters partitioned): ``hf-synced`` and ``hf`` return the greedy tokens
of plain ``generate`` on the unsharded model. (On one rank ``hf-synced`` decodes rank-locally, through the
partitioned model's own forward.)"""

from __future__ import annotations

import argparse
import copy
import json

import torch

from rlhfkit import distributed
from rlhfkit.engines import batch_plan, build_engine
from rlhfkit.models.gathered import is_zero3_partitioned
from rlhfkit.rollout import GenerationConfig, PromptBatch, make_rollout_engine
from transformers import AutoModelForCausalLM, AutoTokenizer

ROWS, NEW = 3, 12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=0)  # the launcher's
    args = ap.parse_args()
    distributed.init()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    ids = torch.randint(5, len(tok), (ROWS, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # one left-padded row
    ids[0, :3] = tok.pad_token_id
    gen = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    plain = copy.deepcopy(model)
    plain.generation_config = type(plain.generation_config)()
    with torch.no_grad():
        want = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    engine = build_engine(copy.deepcopy(model).train(), plan=batch_plan(ROWS, 1), zero_stage=3, dtype="bf16", offload=False,
                          learning_rate=1e-3, weight_decay=0.0, betas=(0.9, 0.95), gradient_clipping=1.0,
                          lr_scheduler_type="constant", num_warmup_steps=0, total_steps=1)
    got = {"partitioned": is_zero3_partitioned(engine.module), "want": want.tolist()}
    for backend in ("hf-synced", "hf"):
        out = make_rollout_engine(backend, engine).generate(PromptBatch(ids, mask), gen).response_ids
        got[backend] = out.tolist()
    with open(args.out, "w") as f:
        json.dump(got, f)


if __name__ == "__main__":
    main()
