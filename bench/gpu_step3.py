"""Step 3 on one GPU (issue 24): every rollout backend and plain `generate`, side by side in one run.

    python bench/gpu_step3.py --prepare_prompts prompts.jsonl          # where ../shared/data is (the CPU)
    python bench/gpu_step3.py --data prompts.jsonl [--batch 8] [--steps 3] [--out bench_gpu_step3.json]
    python bench/gpu_step3.py --data prompts.jsonl --size tiny --prompt 32 --answer 16 --batch 2   # a CPU dry run

Builds its models from configs with random weights (nothing is downloaded; only the SmolLM2 tokenizer
files are read, from --tokenizer): with --size 1b (the default) an actor of about 1.07B parameters (Llama
architecture: hidden 2048, 16 layers, MLP 8192, 32 query heads over 8 key/value heads, SmolLM2's
49152-token vocabulary, tied embeddings) and a critic / reward model of SmolLM2-360M's shape (about 0.36B);
--size tiny is a 2-layer pair for dry runs. Every run has the same fixed settings, printed: one rank, actor
and critic ZeRO-3, bf16, --prompt-token prompts (hh-rlhf text cut to exactly that length), --answer-token
answers forced (--min_new_tokens), --batch prompts per generation and per training batch.

Runs step3_ppo/main.py for real once per backend of --backends (`hf`, `hf-synced`, `deepspeed`: the
Hybrid Engine; a backend that fails is reported with its error, and the others still run), then plain
unsharded `generate` of the actor on the same prompts. Reports, leaving out the first (warm-up) step:
seconds per PPO step and its generation / experience / training split, the generation share, generated
tokens/s, peak memory (the GPU's allocated peak on CUDA, resident memory on the CPU), and the training
phase's model FLOP/s (6 x the parameters in products x the tokens trained, actor and critic) as a share
of a bf16 matmul peak measured in the same script, and of the spec sheet's dense bf16 figure where the
card is known. Figures, never assertions; issue 24's targets are printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from pinned_flags import STEP3
from revisions import REPO, current_tree, pinned_args, run_program, tree_env
from step3 import step_figures
from workloads import exact_length_prompts

HH = REPO / ".." / "shared" / "data" / "hh-rlhf-harmless-base" / "pairs.jsonl.gz"
SCRIPT = "step3_ppo/main.py"
SIZES = {  # name -> (actor, critic) LlamaConfig fields; the vocabulary is the tokenizer's
    "1b": (dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8),
           dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5)),
    "tiny": (dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
             dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)),
}
SPEC_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}  # dense bf16, NVIDIA's spec sheets (SXM)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", default=str(REPO / "runs" / "pipeline-small" / "base"),
                    help="a directory with the SmolLM2 tokenizer files (any rlhfkit checkpoint of the default model)")
    ap.add_argument("--data", help="prompt-only JSONL of exactly --prompt tokens a prompt (--prepare_prompts writes one)")
    ap.add_argument("--prepare_prompts", metavar="PATH", help="only write --data's prompts (from ../shared/data's hh-rlhf) and stop")
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--answer", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="prompts per generation batch and per training batch")
    ap.add_argument("--steps", type=int, default=3, help="PPO steps a backend (the first is not timed)")
    ap.add_argument("--backends", default="hf,hf-synced,deepspeed")
    ap.add_argument("--out", default="bench_gpu_step3.json")
    return ap.parse_args()


def build_checkpoints(tokenizer_dir: str, size: str, work: str) -> tuple[str, str, dict]:
    """Random-weight actor and critic checkpoints (bf16, with the tokenizer) -> their paths and sizes."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True,
                  max_position_embeddings=8192)
    torch.manual_seed(0)
    actor = LlamaForCausalLM(LlamaConfig(**SIZES[size][0], **common)).to(torch.bfloat16)
    critic = LlamaForSequenceClassification(LlamaConfig(**SIZES[size][1], **common, num_labels=1)).to(torch.bfloat16)
    paths = []
    for name, model in (("actor", actor), ("critic", critic)):
        path = os.path.join(work, name)
        model.save_pretrained(path)
        tok.save_pretrained(path)
        paths.append(path)
    sizes = {"actor_params": sum(p.numel() for p in actor.parameters()), "critic_params": sum(p.numel() for p in critic.parameters())}
    # parameters in products: the actor's tied embedding is its LM head (counted once); the critic's is a lookup only
    sizes["product_params"] = sizes["actor_params"] + sizes["critic_params"] - critic.config.vocab_size * critic.config.hidden_size
    return paths[0], paths[1], sizes


def step3_flags(args, backend: str) -> dict:
    """Every pinned step-3 flag at this bench's fixed settings, for one backend."""
    return {**STEP3, "actor_zero_stage": 3, "critic_zero_stage": 3, "dtype": "bf16", "max_prompt_seq_len": args.prompt,
            "max_answer_seq_len": args.answer, "min_new_tokens": args.answer, "per_device_generation_batch_size": args.batch,
            "per_device_training_batch_size": args.batch, "eval_fraction": 0.01, "max_eval_samples": 1,
            "data_split": "0,0,10", "rollout_backend": backend, "enable_hybrid_engine": backend == "deepspeed"}


def run_backend(tree, args, backend: str, actor: str, critic: str, out: str) -> dict:
    """One step-3 run -> its figures (means over the timed steps), or its error."""
    argv, _ = pinned_args(step3_flags(args, backend))
    argv += ["--actor_model_name_or_path", actor, "--critic_model_name_or_path", critic, "--data_path", args.data,
             "--output_dir", out, "--max_steps", str(args.steps)]
    threads = None if torch.cuda.is_available() else max(1, os.cpu_count() or 1)
    try:
        run_program(tree, SCRIPT, argv, nprocs=1, env=tree_env(tree, threads=threads))
    except SystemExit as failed:  # run_program exits with the program's output tail
        return {"name": backend, "error": str(failed)[-1500:]}
    return {"name": backend, **step_figures(out)}


def plain_generate(actor: str, args, device: torch.device) -> dict:
    """Tokens/s of ``generate`` on one unsharded copy of the actor, greedy, the answer forced to --answer tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhfkit.data.tokenize import encode_prompt

    tok = AutoTokenizer.from_pretrained(actor)
    model = AutoModelForCausalLM.from_pretrained(actor, dtype=torch.bfloat16).to(device).eval()
    prompts = [json.loads(x)["prompt"] for x in Path(args.data).read_text().splitlines()][: args.batch]
    ids = torch.tensor([encode_prompt(tok, [{"role": "user", "content": p}]) for p in prompts], device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.answer, min_new_tokens=args.answer, do_sample=False,
                  pad_token_id=model.config.pad_token_id)
    times = []
    with torch.no_grad():
        for _ in range(3):  # the first is a warm-up
            sync(device)
            t = time.perf_counter()
            model.generate(ids, **kwargs)
            sync(device)
            times.append(time.perf_counter() - t)
    best = min(times[1:])
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"name": "plain generate", "seconds": best, "gen_tokens_per_s": len(prompts) * args.answer / best, "peak_gb": peak}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak_tflops(device: torch.device) -> float:
    """bf16 matmul TFLOP/s on ``device``: the fastest of a few large square products."""
    best = 0.0
    for n in ((4096, 8192, 16384) if device.type == "cuda" else (1024, 2048)):
        a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
        b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
        for _ in range(3):
            a @ b
        sync(device)
        t, k = time.perf_counter(), 0
        while time.perf_counter() - t < 2.0:
            a @ b
            k += 1
        sync(device)
        best = max(best, 2 * n**3 * k / (time.perf_counter() - t) / 1e12)
        del a, b
    return best


def spec_tflops(device: torch.device) -> tuple[str, float | None]:
    """The card's name and its spec sheet's dense bf16 TFLOP/s, where known."""
    if device.type != "cuda":
        return "CPU", None
    name = torch.cuda.get_device_name(device)
    return name, next((v for k, v in SPEC_BF16_TFLOPS.items() if k in name), None)


def add_rates(results: list[dict], args, sizes: dict, peak: float, spec: float | None) -> None:
    """Generation share and training-phase MFU of each backend that ran."""
    tokens = args.batch * (args.prompt + args.answer)  # one rank: every prompt trained once a step (1 PPO epoch)
    for r in results:
        if "error" in r:
            continue
        r["generation_share"] = r["generation_s"] / r["step_s"]
        r["training_tflops"] = 6 * sizes["product_params"] * tokens / r["training_s"] / 1e12
        r["training_mfu"] = r["training_tflops"] / peak
        r["training_mfu_spec"] = r["training_tflops"] / spec if spec else None


def print_table(results: list[dict], plain: dict, meta: dict) -> None:
    print(f"\n{meta['device']}: step 3, 1 rank, actor+critic ZeRO-3, bf16, {meta['size']} actor ({meta['actor_params'] / 1e9:.2f}B) "
          f"and critic ({meta['critic_params'] / 1e9:.2f}B), random weights; prompt {meta['prompt']} tokens, answer "
          f"{meta['answer']} forced, {meta['batch']} prompts a batch; {meta['steps']} steps a run, the first not timed")
    print(f"bf16 matmul peak measured: {meta['peak_tflops']:.1f} TFLOP/s; spec sheet: "
          + (f"{meta['spec_tflops']:.0f} TFLOP/s" if meta["spec_tflops"] else "unknown"))
    print(f"{'run':<16}{'s/step':>8}{'gen s':>8}{'exp s':>8}{'train s':>9}{'gen share':>10}{'gen tok/s':>10}{'peak GiB':>9}"
          f"{'train MFU':>10}")
    for r in results:
        if "error" in r:
            print(f"{r['name']:<16} failed: {r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'}")
            continue
        print(f"{r['name']:<16}{r['step_s']:>8.2f}{r['generation_s']:>8.2f}{r['experience_s']:>8.2f}{r['training_s']:>9.2f}"
              f"{r['generation_share']:>10.1%}{r['gen_tokens_per_s']:>10.1f}{r['peak_gb']:>9.2f}{r['training_mfu']:>10.1%}")
    peak = f"{plain['peak_gb']:>9.2f}" if plain["peak_gb"] is not None else f"{'-':>9}"
    print(f"{plain['name']:<16}{'':>8}{plain['seconds']:>8.2f}{'':>8}{'':>9}{'':>10}{plain['gen_tokens_per_s']:>10.1f}{peak}")
    print_targets(results, plain)


def print_targets(results: list[dict], plain: dict) -> None:
    """Issue 24's targets against these figures: met or missed, with the numbers."""
    by = {r["name"]: r for r in results if "error" not in r}
    hybrid = by.get("deepspeed") or by.get("hf")
    if hybrid is None:
        print("targets: no backend ran")
        return
    name = hybrid["name"]
    checks = [(f"generation share of a step <= 50% ({name}, {hybrid['step_s']:.2f} s a step)", hybrid["generation_share"], 0.5, "<="),
              (f"training-phase MFU >= 40% of the measured peak ({name})", hybrid["training_mfu"], 0.4, ">="),
              (f"{name} >= 1x plain generate in tokens/s", hybrid["gen_tokens_per_s"] / plain["gen_tokens_per_s"], 1.0, ">=")]
    if "hf-synced" in by:
        checks.append((f"{name} >= 5x hf-synced in tokens/s", hybrid["gen_tokens_per_s"] / by["hf-synced"]["gen_tokens_per_s"], 5.0, ">="))
    for text, value, bound, op in checks:
        ok = value <= bound if op == "<=" else value >= bound
        print(f"target: {text}: {value:.3g} -> {'met' if ok else 'MISSED'}")


def main() -> None:
    args = parse_args()
    if args.prepare_prompts:
        from transformers import AutoTokenizer

        exact_length_prompts(str(HH), AutoTokenizer.from_pretrained(args.tokenizer), args.prepare_prompts,
                             rows=max(64, 8 * args.batch * args.steps), length=args.prompt)
        print(f"written {args.prepare_prompts}: prompts of exactly {args.prompt} tokens")
        return
    if not args.data:
        raise SystemExit("--data: a prompt file of exactly --prompt tokens a prompt (write one with --prepare_prompts PATH)")
    args.data = os.path.abspath(args.data)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tree = current_tree()
    card, spec = spec_tflops(device)
    meta = {"device": card, "spec_tflops": spec, "peak_tflops": matmul_peak_tflops(device), **vars(args)}
    with tempfile.TemporaryDirectory() as work:
        actor, critic, sizes = build_checkpoints(args.tokenizer, args.size, work)
        meta.update(sizes)
        print(f"fixed settings: {json.dumps({k: meta[k] for k in ('size', 'prompt', 'answer', 'batch', 'steps')})}", flush=True)
        results = []
        for backend in [b.strip() for b in args.backends.split(",")]:
            results.append(run_backend(tree, args, backend, actor, critic, os.path.join(work, backend)))
            print(f"{backend}: " + (f"{results[-1]['step_s']:.2f} s/step" if "error" not in results[-1] else "failed"), flush=True)
            write(args.out, meta, results, None)  # so far: a run stopped at its time limit keeps what it measured
        plain = plain_generate(actor, args, device)
    add_rates(results, args, sizes, meta["peak_tflops"], spec)
    print_table(results, plain, meta)
    write(args.out, meta, results, plain)
    print(f"written {args.out}")


def write(path: str, meta: dict, results: list[dict], plain: dict | None) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": results, "plain_generate": plain}, f, indent=2)


if __name__ == "__main__":
    main()
