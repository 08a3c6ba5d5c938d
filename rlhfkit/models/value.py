"""Former home of the attention and score helpers, kept so that code importing from
``rlhfkit.models.value`` still works. New code imports from :mod:`rlhfkit.models` or from the
modules named after what they hold:

- :mod:`rlhfkit.models.attention`: position ids, the attention kernel, 4D masks, the attention span;
- :mod:`rlhfkit.models.scores`: head values and sequence scores, summed response log-probs, for
  padded rows and packed pairs.
"""

from __future__ import annotations

from rlhfkit.models.attention import (  # noqa: F401 - re-exported
    additive_mask, attention_kernel_of, attention_span, position_ids, takes_4d_mask,
)
from rlhfkit.models.scores import packed_pair_scores, score_head, sequence_scores, token_values  # noqa: F401 - re-exported
