"""Model loading, LoRA, attention helpers, sequence scores and log-probs, and the embedded base model."""

from rlhfkit.models.attention import additive_mask, attention_kernel_of, attention_span, position_ids, takes_4d_mask
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
from rlhfkit.models.scores import (
    at_predicting_column, head_inputs_at_last_token, packed_pair_head_inputs, packed_pair_scores, packed_sequence_logprobs,
    pair_logprobs, pair_response_lengths, response_labels, score_head, scores_and_head_inputs, sequence_logprobs,
    sequence_scores, token_values,
)

__all__ = [
    "additive_mask", "apply_lora", "at_predicting_column", "attention_kernel_of", "attention_span", "check_weights_policy",
    "enable_gradient_checkpointing", "ensure_distinct_pad", "head_inputs_at_last_token", "is_peft",
    "load_model", "load_tokenizer", "packed_pair_head_inputs", "packed_pair_scores", "packed_sequence_logprobs",
    "pair_logprobs", "pair_response_lengths", "param_groups",
    "plain_init", "position_ids", "response_labels", "score_head", "scores_and_head_inputs", "sequence_logprobs",
    "sequence_scores",
    "takes_4d_mask", "token_values", "torch_dtype", "train_attention",
]
