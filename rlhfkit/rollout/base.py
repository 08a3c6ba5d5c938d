"""The rollout interface every backend implements, and the pieces they share.

A rollout turns a batch of left-padded prompts into responses (DESIGN section 5)::

    prompts (PromptBatch) --generate--> RolloutBatch(prompt_ids, prompt_mask, response_ids, action_mask, truncated)

Every backend ends in :func:`postprocess`, so all of them return the same batch for the same tokens:
the response stops at the first EOS (the EOS itself is an action, mask 1), everything after it is
``pad_token_id`` with mask 0, and a response with no EOS within ``max_new_tokens`` is ``truncated``.

Shapes: B prompts (this rank's), P prompt length (left-padded), A response length (the longest
response in this batch, <= max_new_tokens).

A program hands every backend the same :class:`RolloutOptions`; each backend class is a
:class:`RolloutBackend` that declares what it needs from the program (an environment check, a
section of the actor's DeepSpeed config, constructor options), so programs never test its name.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Protocol, Sequence, runtime_checkable

import torch

from rlhfkit.errors import ConfigError

if TYPE_CHECKING:
    from rlhfkit.models.gathered import GatheredCopy


@dataclass(kw_only=True)
class GenerationConfig:
    """How to sample a response. Every field is passed to the model explicitly: nothing is taken from
    the model's own ``generation_config.json`` (a saved temperature or top_k must not leak into RL)."""

    max_new_tokens: int  # hard limit on response tokens; a response that reaches it without EOS is truncated
    temperature: float = 1.0  # softmax temperature (sampling only); 1.0 = the policy's own distribution
    top_p: float = 1.0  # nucleus sampling mass (sampling only); 1.0 = off
    top_k: int = 0  # keep the k most likely tokens (sampling only); 0 = off
    min_new_tokens: int = 0  # EOS is suppressed for this many steps; 0 = EOS allowed at every step
    do_sample: bool = True  # False = greedy decoding (tests, evaluation)
    eos_token_id: int | list[int]  # one or several ids that end a response
    pad_token_id: int  # fills the response after EOS (its action mask is 0)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ConfigError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}")
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be > 0 (use do_sample=False for greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not self.eos_ids:
            raise ConfigError("eos_token_id is empty: responses could never end")

    @property
    def eos_ids(self) -> list[int]:
        """``eos_token_id`` as a list."""
        ids = self.eos_token_id
        return [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]

    def to_hf(self):
        """The equivalent ``transformers.GenerationConfig``, with every sampling knob set.

        Greedy leaves the sampling fields unset (transformers warns about sampling values when
        ``do_sample=False``); they cannot leak from the model because backends generate through
        :func:`rlhfkit.rollout.sampling.isolated_generation_config`.
        """
        from transformers import GenerationConfig as HFGenerationConfig

        kwargs: dict[str, Any] = dict(
            max_new_tokens=self.max_new_tokens,
            min_new_tokens=self.min_new_tokens,
            do_sample=self.do_sample,
            num_beams=1,
            num_return_sequences=1,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_token_id,
            use_cache=True,  # a gradient-checkpointed model has config.use_cache=False; generation wants the cache
        )
        if self.do_sample:
            kwargs.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        return HFGenerationConfig(**kwargs)


@dataclass
class PromptBatch:
    """This rank's prompts, left-padded (the last column is real for every row)."""

    input_ids: torch.Tensor  # [B, P] long, left-padded
    attention_mask: torch.Tensor  # [B, P] 0/1, 0 over the left padding

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2 or self.input_ids.shape != self.attention_mask.shape:
            raise ValueError(f"PromptBatch wants input_ids and attention_mask of one shape [B, P], got "
                             f"{tuple(self.input_ids.shape)} and {tuple(self.attention_mask.shape)}")
        if self.input_ids.numel() and not bool(self.attention_mask[:, -1].all()):
            raise ValueError("PromptBatch must be left-padded: every row's last position must be a real token")

    def __len__(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class RolloutBatch:
    """Prompts and their responses; identical for every backend given the same tokens."""

    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P] 0/1
    response_ids: torch.Tensor  # [B, A] long, pad_token_id after the first EOS
    action_mask: torch.Tensor  # [B, A] 0/1, 1 up to and including the first EOS, 0 after
    truncated: torch.Tensor  # [B] bool, True where no EOS came within max_new_tokens

    @property
    def sequences(self) -> torch.Tensor:
        """[B, P + A] prompt ++ response."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """[B, P + A] prompt_mask ++ action_mask."""
        return torch.cat([self.prompt_mask, self.action_mask.to(self.prompt_mask.dtype)], dim=1)

    @property
    def response_lengths(self) -> torch.Tensor:
        """[B] number of response tokens, EOS included."""
        return self.action_mask.sum(dim=1)

    @property
    def empty(self) -> torch.Tensor:
        """[B] bool: the response is its EOS alone (nothing said before it)."""
        return empty_responses(self.action_mask, self.truncated)

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]


def empty_responses(action_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """[B] bool from a response mask [B, A] (1 up to and including EOS) and [B] truncated: EOS came first."""
    return (action_mask.sum(dim=1) <= 1) & ~truncated.to(action_mask.device).bool()


@dataclass(kw_only=True)
class RolloutOptions:
    """What the program's flags ask of the rollout backend, in one object for every backend: each
    backend reads the fields it uses (see :class:`RolloutBackend`) and ignores the others. The
    defaults are those of step 3's flags."""

    keep_copy: bool = False  # hf: keep the actor's gathered inference copy between calls (refreshed at each call): more memory, no rebuild
    inference_tp_size: int = 1  # deepspeed (Hybrid Engine): tensor-parallel size of its inference kernels
    release_inference_cache: bool = False  # deepspeed (Hybrid Engine): free its inference workspace after each generation
    pin_parameters: bool = True  # deepspeed (Hybrid Engine): keep the actor's gathered parameters pinned between generations
    tp_gather_partition_size: int = 8  # deepspeed (Hybrid Engine): partition size of its tensor-parallel gather


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates responses for this rank's prompts. Collective: every rank calls it together."""

    # The gathered model this engine generates with, for the experience passes to reuse (they then
    # score the responses on the weights that sampled them, without a second gather); None when the
    # engine keeps no such copy.
    inference_copy: GatheredCopy | None

    def generate(self, prompts: PromptBatch, gen: GenerationConfig) -> RolloutBatch: ...

    def release(self) -> None:
        """Free what the engine keeps between calls (its inference copy)."""


class RolloutBackend:
    """What every backend class declares besides :class:`RolloutEngine`'s methods, so that a program
    treats all backends alike (``rlhfkit.rollout.check_backend``, ``training_engine_options``,
    ``make_rollout_engine``). The defaults suit a backend that needs nothing special."""

    inference_copy: GatheredCopy | None = None  # see RolloutEngine.inference_copy

    @classmethod
    def check_environment(cls) -> None:
        """Raise a ConfigError when this machine cannot run the backend (called before any model is loaded)."""

    @classmethod
    def training_engine_options(cls, options: RolloutOptions) -> dict | None:
        """The ``hybrid_engine`` section the actor's DeepSpeed training engine needs for this backend, or None."""
        return None

    @classmethod
    def init_kwargs(cls, options: RolloutOptions) -> dict[str, Any]:
        """The constructor's keyword arguments that ``options`` sets."""
        return {}

    def release(self) -> None:
        """Free what the engine keeps between calls (nothing by default)."""


def postprocess(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, generated_ids: torch.Tensor,
                eos_ids: int | Sequence[int], pad_id: int) -> RolloutBatch:
    """Cut raw generated tokens at their first EOS and build the masks.

    Args:
        prompt_ids: [B, P] left-padded prompts.
        prompt_mask: [B, P] their attention mask.
        generated_ids: [B, G] the tokens generated after the prompt (whatever fills the tail).
        eos_ids: the EOS id(s); the first one that appears ends the response and is kept (mask 1).
        pad_id: written over everything after the first EOS. It may equal an EOS id: the mask, not
            the token, tells where the response ends.

    Returns:
        RolloutBatch with A = the longest response (EOS included) in the batch, <= G.
    """
    if generated_ids.dim() != 2 or generated_ids.shape[0] != prompt_ids.shape[0]:
        raise ValueError(f"generated_ids must be [B={prompt_ids.shape[0]}, G], got {tuple(generated_ids.shape)}")
    eos = torch.as_tensor([eos_ids] if isinstance(eos_ids, int) else list(eos_ids),
                          dtype=generated_ids.dtype, device=generated_ids.device)
    B, G = generated_ids.shape
    is_eos = torch.isin(generated_ids, eos)  # [B, G]
    has_eos = is_eos.any(dim=1)  # [B]
    first_eos = is_eos.int().argmax(dim=1) if G > 0 else has_eos.long()  # [B] index of the first EOS (0 where none)
    lengths = torch.where(has_eos, first_eos + 1, torch.full_like(first_eos, G))  # [B]
    A = int(lengths.max()) if B > 0 else 0
    positions = torch.arange(A, device=generated_ids.device).unsqueeze(0)  # [1, A]
    action_mask = (positions < lengths.unsqueeze(1)).to(prompt_mask.dtype)  # [B, A]
    response_ids = generated_ids[:, :A].masked_fill(action_mask == 0, pad_id)
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        action_mask=action_mask, truncated=~has_eos)


# ---------------------------------------------------------------------------------------------
# Helpers shared by the backends.

# Moved to rlhfkit.models.gathered (the inference copy needs them and must not import the rollout);
# still importable from here. Resolved on first use: importing rlhfkit.models imports transformers.
_MOVED_TO_GATHERED = ("hf_model_of", "is_peft_model", "is_zero3_partitioned", "model_device", "unwrap_engine")


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_GATHERED:
        from rlhfkit.models import gathered

        return getattr(gathered, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """Put every submodule in eval mode (dropout off, KV cache allowed with gradient checkpointing)
    and restore each one's own mode afterwards."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def empty_rollout(prompts: PromptBatch, device: torch.device) -> RolloutBatch:
    """The result for a rank that has no prompts this round."""
    ids = prompts.input_ids.to(device)
    return RolloutBatch(prompt_ids=ids, prompt_mask=prompts.attention_mask.to(device),
                        response_ids=ids.new_zeros((0, 0)), action_mask=prompts.attention_mask.new_zeros((0, 0)).to(device),
                        truncated=torch.zeros(0, dtype=torch.bool, device=device))
