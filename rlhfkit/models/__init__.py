"""Model loading, LoRA, and the embedded base model."""

from rlhfkit.models.loading import (
    check_weights_policy,
    enable_gradient_checkpointing,
    ensure_distinct_pad,
    load_model,
    load_tokenizer,
    plain_init,
    torch_dtype,
    train_attention,
)
from rlhfkit.models.lora import apply_lora, is_peft, param_groups
from rlhfkit.models.value import (
    additive_mask, attention_kernel_of, attention_span, packed_pair_scores, position_ids, score_head, sequence_scores, takes_4d_mask,
    token_values,
)

__all__ = [
    "additive_mask", "apply_lora", "attention_kernel_of", "attention_span", "check_weights_policy", "enable_gradient_checkpointing",
    "ensure_distinct_pad", "is_peft",
    "load_model", "load_tokenizer", "packed_pair_scores", "param_groups", "plain_init", "position_ids", "score_head", "sequence_scores",
    "takes_4d_mask", "token_values", "torch_dtype", "train_attention",
]
