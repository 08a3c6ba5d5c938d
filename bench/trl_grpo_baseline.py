"""TRL's GRPOTrainer at bench/grpo.py's settings, for a same-run baseline (bench only; needs `pip install trl`).

    python bench/trl_grpo_baseline.py --model BASE_OR_SFT_DIR --data GSM8K_JSONL --steps 5 --out trl.json

One process, the machine's threads, bf16 weights, 1 GSM8K prompt x 4 samples a step, every
completion forced to --new_tokens tokens (min_new_tokens, as rlhfkit's bench forces them), one
optimiser step per generation batch, the reward rlhfkit's gsm8k rule, beta (the KL coefficient of
the loss) as rlhfkit's GRPO default so that both load and run a reference model. Writes the
steady-state seconds per step (the first step left out). Not part of the library; not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhfkit.rewards import gsm8k_reward

    torch.set_num_threads(os.cpu_count() or 2)
    rows = [json.loads(x) for x in open(args.data)][: args.steps + 2]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]} for r in rows])

    def reward(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return gsm8k_reward(prompts, texts, [{"answer": a} for a in answer])

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.t = [], None

        def on_step_begin(self, *_, **__):
            self.t = time.time()

        def on_step_end(self, *_, **__):
            self.times.append(time.time() - self.t)

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    config = GRPOConfig(output_dir=os.path.join(os.path.dirname(os.path.abspath(args.out)), "trl-grpo"), use_cpu=True, bf16=True,
                        per_device_train_batch_size=args.samples, num_generations=args.samples,
                        max_completion_length=args.new_tokens, generation_kwargs={"min_new_tokens": args.new_tokens},
                        beta=args.beta, max_steps=args.steps, learning_rate=1e-6, logging_steps=1, report_to=[],
                        save_strategy="no", shuffle_dataset=False, seed=1234, dataloader_num_workers=0)
    timer = Timer()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tok,
                          callbacks=[timer])
    trainer.train()
    timed = timer.times[1:] or timer.times
    step_s = sum(timed) / len(timed)
    with open(args.out, "w") as f:
        json.dump({"step_s": step_s, "completions_per_s": args.samples / step_s, "steps_timed": len(timed),
                   "trl_version": __import__("trl").__version__, "beta": args.beta}, f)


if __name__ == "__main__":
    main()
