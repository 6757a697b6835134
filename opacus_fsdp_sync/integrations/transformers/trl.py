"""``DPSFTTrainer``: TRL's ``SFTTrainer`` with DP-SGD (extra ``[trl]``).

TRL prepares the data (chat templates, prompt/completion records, completion-only and
assistant-only labels, truncation to ``max_length``) as usual; each record stays one example.
Packing and padding-free batches are refused (several records in one example).
Activation checkpointing, on by default in ``SFTConfig``, is turned off (logged).
"""

from __future__ import annotations

from trl import SFTTrainer

from .mixin import DPTrainerMixin


class DPSFTTrainer(DPTrainerMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` that trains with DP-SGD (exact per-example clipping).

    Replace ``SFTTrainer`` by ``DPSFTTrainer`` and add ``dp_args``; nothing else changes. The
    per-example loss is the mean next-token cross-entropy over the example's trained tokens
    (TRL's labels: -100 on prompts with ``completion_only_loss``, on non-assistant turns with
    ``assistant_only_loss``, and on padding).

    Args:
        *args: ``SFTTrainer``'s positional arguments.
        dp_args: The DP arguments.
        **kwargs: ``SFTTrainer``'s keyword arguments.
    """

    dp_checkpointing_off_by_default = True
