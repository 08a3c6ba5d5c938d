"""``rlhfkit plan``: per-rank memory of a program before it runs, from a model's config alone.

For each model of the program it adds up, per rank:
- model states: weights, gradients and optimizer states (fp32 master weights and Adam's two moments under
  mixed precision), each divided by the ranks where the ZeRO stage partitions it (stage 1: optimizer
  states, 2: and gradients, 3: and weights); ``--offload`` moves optimizer states (and, under ZeRO-3,
  weights) to host memory; LoRA trains (and keeps optimizer states for) only its adapters;
- under ZeRO-3, the parameters a forward and backward pass keep gathered (DeepSpeed's
  ``stage3_max_live_parameters``, 1e9 elements here) and, in step 3, the gathered copies that rollout and
  the experience pass run on;
- activations at the given micro batch and lengths, with or without gradient checkpointing, and the
  logits of the language-model loss;
- the rollout's KV cache (step 3);
- frozen models (step 3's reference and reward model): weights only, partitioned under ZeRO-3.
Peak memory is the largest of the program's phases (step 3: generation, experience, training), plus a
per-rank runtime constant (communication buffers, the allocator's slack, the data).

Constants fitted to measured CPU runs (``FIT_CASES``, see bench/plan_check.py): the runtime constant and,
for ``--device cpu`` only, the buffers of ZeRO-3's gloo collectives; the activation scale is 1 (per-token
tensors counted from the architecture). Every other figure follows from the config and the settings. The largest
micro batch that fits ``--device_memory_gib`` is found by trying batches in turn.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from rlhfkit.errors import ConfigError

GIB = 2**30
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
MAX_LIVE_PARAMETERS = 1e9  # rlhfkit.ds_config's stage3_max_live_parameters
BUCKET_ELEMENTS = 2e7  # rlhfkit.ds_config's reduce and allgather buckets (ZeRO >= 1)
# fitted on FIT_CASES by bench/plan_check.py --fit (step 1: 1 rank ZeRO-0 gives the runtime constant, then 2 ranks
# ZeRO-3 the CPU collective buffers), checked on the other rows
ACTIVATION_SCALE = 1.0
RUNTIME_GIB = 0.82
CPU_COLLECTIVE_BYTES = 2.8  # per gathered parameter: ZeRO-3's gathers and reduce-scatters through gloo on the CPU
FIT_CASES = {("step1", 1, 0), ("step1", 2, 3)}
PROGRAMS = ("step1", "step2", "dpo", "step3")


@dataclass
class Arch:
    """What memory depends on in a decoder-only (Llama-like) config."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool

    @classmethod
    def from_config(cls, cfg: dict) -> "Arch":
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            return cls(vocab=int(cfg["vocab_size"]), hidden=hidden, layers=int(cfg["num_hidden_layers"]), heads=heads,
                       kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=int(cfg.get("head_dim") or hidden // heads),
                       intermediate=int(cfg.get("intermediate_size") or 4 * hidden), tied=bool(cfg.get("tie_word_embeddings", False)))
        except KeyError as e:
            raise ConfigError(f"the model config has no {e.args[0]!r}: rlhfkit plan reads decoder-only (Llama-like) configs") from None

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of one block's linear layers: q, k, v, o, gate, up, down."""
        q, kv, h, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]

    def params(self, lm_head: bool) -> int:
        block = sum(a * b for a, b in self.linear_shapes()) + 2 * self.hidden
        head = self.vocab * self.hidden if lm_head and not self.tied else (0 if lm_head else self.hidden)
        return self.vocab * self.hidden + self.layers * block + self.hidden + head

    def lora_params(self, r: int) -> int:
        return self.layers * sum(r * (a + b) for a, b in self.linear_shapes())


@functools.lru_cache(maxsize=16)
def load_arch(path: str) -> Arch:
    """A model directory (its config.json) or a config.json file; no weights are read. Cached: largest_batch
    plans the same model once per batch size."""
    p = Path(path)
    cfg_file = p / "config.json" if p.is_dir() else p
    if not cfg_file.is_file():
        raise ConfigError(f"--model {path}: no config.json there (give a model directory or a config.json)")
    return Arch.from_config(json.loads(cfg_file.read_text()))


@dataclass
class PlanSettings:
    program: str = "step1"
    world_size: int = 1
    zero_stage: int = 0
    dtype: str = "bf16"
    offload: bool = False
    lora_dim: int = 0
    gradient_checkpointing: bool = False
    per_device_train_batch_size: int = 4
    max_seq_len: int = 512
    per_device_generation_batch_size: int = 4
    per_device_training_batch_size: int = 4
    max_prompt_seq_len: int = 256
    max_answer_seq_len: int = 256
    n_samples_per_prompt: int = 1
    device: str = "cuda"  # "cpu": DeepSpeed's CPU accelerator, whose ZeRO-3 collectives (gloo) add buffers

    def check(self) -> None:
        if self.program not in PROGRAMS:
            raise ConfigError(f"--program {self.program}: use one of {', '.join(PROGRAMS)}")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"--dtype {self.dtype}: use bf16, fp16 or fp32")
        if self.zero_stage not in (0, 1, 2, 3) or self.world_size < 1:
            raise ConfigError("--zero_stage is 0-3 and --world_size at least 1")
        if self.offload and self.zero_stage == 0:
            raise ConfigError("--offload needs --zero_stage 1, 2 or 3, as in the programs")


@dataclass
class Line:
    model: str
    part: str
    bytes: float
    phase: str = "all"  # "all", or the one phase (train, generation, experience) that holds it
    host: bool = False  # offloaded to host memory

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass
class Plan:
    settings: PlanSettings
    lines: list[Line] = field(default_factory=list)

    def peak(self, host_too: bool) -> tuple[float, str]:
        """(GiB per rank at the largest phase, that phase); ``host_too``: count offloaded parts (a CPU run)."""
        phases = sorted({ln.phase for ln in self.lines if ln.phase != "all"}) or ["all"]
        best = (0.0, phases[0])
        for ph in phases:
            total = sum(ln.bytes for ln in self.lines if ln.phase in ("all", ph) and (host_too or not ln.host)) / GIB
            best = max(best, (total + RUNTIME_GIB, ph))
        return best

    @property
    def device_total_gib(self) -> float:
        return self.peak(host_too=False)[0]

    @property
    def host_total_gib(self) -> float:
        return self.peak(host_too=True)[0]


def model_states(name: str, n_params: int, trainable: int, s: PlanSettings, train_phase: str = "train") -> list[Line]:
    """Weights, gradients and optimizer states of a trained model, per rank."""
    b, n = DTYPE_BYTES[s.dtype], s.world_size
    shard = {k: (n if s.zero_stage >= k else 1) for k in (1, 2, 3)}
    lines = [Line(name, "weights", b * n_params / shard[3], host=s.offload and s.zero_stage == 3),
             Line(name, "gradients", b * trainable / shard[2])]
    optim = 8 * trainable + (4 * trainable if b < 4 else 0)  # Adam moments (+ fp32 master weights)
    # mixed precision: fp32 gradients for the step (DeepSpeed's bf16 optimizer keeps them whole at ZeRO-0)
    grads32 = 4 * trainable / shard[1] if b < 4 else 0
    lines.append(Line(name, "optimizer states (fp32 master + Adam)", optim / shard[1], host=s.offload))
    if grads32:  # made for the optimizer step, when the activations are gone
        lines.append(Line(name, "fp32 gradients (optimizer step)", grads32, phase=f"{train_phase}: optimizer step",
                          host=s.offload))
    if s.zero_stage >= 1:
        lines.append(Line(name, "ZeRO buckets", 2 * BUCKET_ELEMENTS * b))
    if s.zero_stage == 3:
        live = min(n_params, MAX_LIVE_PARAMETERS)
        lines.append(Line(name, "gathered for forward/backward (ZeRO-3)", b * live, phase=train_phase))
        if s.device == "cpu" and n > 1:
            lines.append(Line(name, "gloo collective buffers (CPU, fp32, fitted)", CPU_COLLECTIVE_BYTES * live, phase=train_phase))
    return lines


def activations(a: Arch, rows: int, seq: int, logit_positions: int, s: PlanSettings) -> float:
    """Bytes a forward + backward pass keeps: per token per block the saved tensors of attention, the MLP and
    the two norms (their fp32 internals), or only the block inputs with gradient checkpointing (plus one block
    recomputed); the loss's logits. Attention kernels (SDPA, flash) keep no T x T matrix."""
    b = DTYPE_BYTES[s.dtype]
    kv = a.kv_heads * a.head_dim
    per_token_block = b * (11 * a.hidden + 2 * kv + 4 * a.intermediate)
    blocks = a.layers * rows * seq * per_token_block
    if s.gradient_checkpointing:
        blocks = a.layers * rows * seq * b * a.hidden + rows * seq * per_token_block
    logits = logit_positions * a.vocab * (b + 12)  # logits, their fp32 log-softmax and its gradient
    return ACTIVATION_SCALE * (blocks + logits)


def trained(name: str, a: Arch, lm_head: bool, s: PlanSettings, rows: int, seq: int, logit_positions: int,
            phase: str = "train") -> list[Line]:
    n_params = a.params(lm_head)
    trainable = a.lora_params(s.lora_dim) if s.lora_dim else n_params
    return [*model_states(name, n_params, trainable, s, phase),
            Line(name, f"activations ({rows} x {seq} tokens"
                       f"{', gradient checkpointing' if s.gradient_checkpointing else ''})",
                 activations(a, rows, seq, logit_positions, s), phase=phase)]


def frozen(name: str, a: Arch, lm_head: bool, s: PlanSettings, offload: bool = False) -> Line:
    shard = s.world_size if s.zero_stage == 3 else 1
    return Line(name, "weights (frozen)", DTYPE_BYTES[s.dtype] * a.params(lm_head) / shard, host=offload)


def plan_step3(a: Arch, critic: Arch, s: PlanSettings) -> list[Line]:
    """Actor and critic trained; reference and reward model frozen; a rollout on a gathered copy of the actor
    with a KV cache; the experience pass's logits; the actor's then the critic's training pass."""
    b = DTYPE_BYTES[s.dtype]
    seq = s.max_prompt_seq_len + s.max_answer_seq_len
    gen_rows = s.per_device_generation_batch_size * s.n_samples_per_prompt
    train_rows = s.per_device_training_batch_size
    lines = [*trained("actor", a, True, s, train_rows, seq, train_rows * s.max_answer_seq_len, phase="actor training"),
             *trained("critic", critic, False, s, train_rows, seq, 0, phase="critic training"),
             frozen("reference", a, True, s), frozen("reward model", critic, False, s)]
    if s.zero_stage == 3:  # rollout and experience run on gathered, hook-free copies (one model's at a time)
        lines.append(Line("actor", "gathered copy for rollout", b * a.params(True), phase="generation"))
        lines.append(Line("actor/reference", "gathered copy for experience", b * max(a.params(True), critic.params(False)),
                          phase="experience"))
    kv = 2 * a.layers * a.kv_heads * a.head_dim * seq * gen_rows * b
    lines.append(Line("actor", f"KV cache ({gen_rows} x {seq} tokens)", kv, phase="generation"))
    lines.append(Line("actor", "rollout logits (one step, fp32)", gen_rows * a.vocab * 4 * 2, phase="generation"))
    exp_logits = gen_rows * s.max_answer_seq_len * a.vocab * (b + 4 + 4)  # bf16 logits, fp32 copy, log-softmax
    lines.append(Line("actor/reference", "experience logits", exp_logits, phase="experience"))
    return lines


def packed_pair_len(max_seq_len: int) -> int:
    """Tokens of a packed pair row (prompt + chosen + rejected, each side <= max_seq_len), taking the prompt as
    half of max_seq_len: 1.5 x max_seq_len (2x with no prompt, 1x with answers of one token)."""
    return max_seq_len + max_seq_len // 2


def plan(model: str, s: PlanSettings, critic: Optional[str] = None) -> Plan:
    """The memory plan of program ``s.program`` for ``model`` (and step 3's ``critic``: default the same config)."""
    s.check()
    a = load_arch(model)
    if s.program == "step1":
        rows, seq = s.per_device_train_batch_size, s.max_seq_len
        lines = trained("model", a, True, s, rows, seq, rows * seq)
    elif s.program == "step2":  # a pair packed in one row: the prompt once, then the chosen and the rejected answer
        rows, seq = s.per_device_train_batch_size, packed_pair_len(s.max_seq_len)
        lines = trained("reward model", a, False, s, rows, seq, 0)
    elif s.program == "dpo":
        rows, seq = s.per_device_train_batch_size, packed_pair_len(s.max_seq_len)
        lines = [*trained("policy", a, True, s, rows, seq, rows * seq), frozen("reference", a, True, s)]
    else:
        lines = plan_step3(a, load_arch(critic) if critic else a, s)
    return Plan(s, lines)


def largest_batch(model: str, s: PlanSettings, device_gib: float, critic: Optional[str] = None,
                  host_too: bool = False) -> int:
    """The largest per-rank micro batch (step 3: generation and training batch together) that fits, 0 if none."""
    key = "per_device_generation_batch_size" if s.program == "step3" else "per_device_train_batch_size"
    best = 0
    for batch in range(1, 4097):
        t = replace(s, **{key: batch}, **({"per_device_training_batch_size": batch} if s.program == "step3" else {}))
        if plan(model, t, critic).peak(host_too)[0] > device_gib:
            break
        best = batch
    return best


def first_changes(p: Plan) -> list[str]:
    """What to change first when it does not fit, the largest consumer first."""
    s, tips = p.settings, []
    states = sum(ln.bytes for ln in p.lines if "optimizer" in ln.part or "gradients" in ln.part or ln.part == "weights")
    acts = sum(ln.bytes for ln in p.lines if ln.part.startswith("activations"))
    if states >= acts:
        if s.zero_stage < 3:
            tips.append(f"--zero_stage 3 (model states divided by the {s.world_size} ranks; more ranks divide them further)")
        if not s.offload:
            tips.append("--offload (optimizer states to host memory)")
        if not s.lora_dim:
            tips.append("--lora_dim 16 --only_optimize_lora (optimizer states for the adapters only)")
    if not s.gradient_checkpointing:
        tips.append("--gradient_checkpointing (activations: block inputs only)")
    tips.append("a smaller micro batch with more --gradient_accumulation_steps (same global batch)")
    return tips


# ----------------------------------------------------------------------------------------------
# the command

DESCRIPTION = ("Per-rank memory of a program before it runs, from the model's config.json alone (no weights read): "
               "model states, activations, step 3's gathered copies and KV cache, and the frozen models, at the "
               "given ranks, ZeRO stage, batch and lengths; and the largest micro batch that fits --device_memory_gib.")


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="a model directory or its config.json (e.g. a 7B Llama's)")
    p.add_argument("--critic", default=None, help="step 3: the critic / reward model's directory or config (default: --model)")
    p.add_argument("--program", choices=PROGRAMS, default="step1")
    p.add_argument("--world_size", type=int, default=1, help="data-parallel ranks (GPUs) in all")
    p.add_argument("--zero_stage", type=int, default=0)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--offload", action="store_true", help="ZeRO-Offload: optimizer states (ZeRO-3: and weights) in host memory")
    p.add_argument("--lora_dim", type=int, default=0, help="LoRA rank: only the adapters train")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: DeepSpeed's CPU accelerator (host memory)")
    for name, default in (("per_device_train_batch_size", 4), ("max_seq_len", 512), ("per_device_generation_batch_size", 4),
                          ("per_device_training_batch_size", 4), ("max_prompt_seq_len", 256), ("max_answer_seq_len", 256),
                          ("n_samples_per_prompt", 1)):
        p.add_argument(f"--{name}", type=int, default=default, help="as the program's flag")
    p.add_argument("--device_memory_gib", type=float, default=None, help="memory per device: report the largest batch that fits")


def render(p: Plan) -> list[str]:
    s = p.settings
    out = [f"{s.program}: {s.world_size} rank(s), ZeRO-{s.zero_stage}{' + offload' if s.offload else ''}, {s.dtype}"
           f"{f', LoRA {s.lora_dim}' if s.lora_dim else ''}{', gradient checkpointing' if s.gradient_checkpointing else ''}",
           f"{'model':16} {'part':56} {'GiB/rank':>9}  phase"]
    for ln in p.lines:
        out.append(f"{ln.model:16} {ln.part:56} {ln.gib:9.3f}  {ln.phase}{' (host)' if ln.host else ''}")
    device, phase = p.peak(host_too=False)
    out.append(f"{'runtime':16} {'buffers, allocator slack, data (fitted)':56} {RUNTIME_GIB:9.3f}  all")
    out.append(f"peak per rank: {device:.2f} GiB on the device (at {phase})"
               + (f", {p.host_total_gib - device:.2f} GiB more in host memory (offloaded)" if s.offload else ""))
    return out


def run(args) -> Plan:
    fields = {k: getattr(args, k) for k in PlanSettings.__dataclass_fields__}
    p = plan(args.model, PlanSettings(**fields), args.critic)
    print("\n".join(render(p)))
    if args.device_memory_gib:
        fits = p.device_total_gib <= args.device_memory_gib
        key = "per_device_generation_batch_size" if p.settings.program == "step3" else "per_device_train_batch_size"
        best = largest_batch(args.model, p.settings, args.device_memory_gib, args.critic)
        print(f"{args.device_memory_gib:g} GiB per device: {'fits' if fits else 'does NOT fit'}; the largest --{key} that fits: "
              + (str(best) if best else "none at these settings"))
        if not fits or not best:
            print("change first: " + "; ".join(first_changes(p)))
    return p
