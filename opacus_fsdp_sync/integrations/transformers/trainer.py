"""``DPTrainer``: ``transformers.Trainer`` with DP-SGD (extra ``[hf]``)."""

from __future__ import annotations

from transformers import Trainer

from .mixin import DPTrainerMixin


class DPTrainer(DPTrainerMixin, Trainer):
    """A ``transformers.Trainer`` that trains with DP-SGD (exact per-example clipping).

    Replace ``Trainer`` by ``DPTrainer`` and add ``dp_args``; nothing else changes::

        trainer = DPTrainer(model=model, args=training_args, train_dataset=train,
                            dp_args=DPArguments(target_epsilon=8.0, delta=1e-5))
        trainer.train()

    The model may come plain (one device, or DDP through accelerate under ``torchrun``) or
    sharded with ``fully_shard`` by the user (FSDP2). See ``docs/hf.md`` for what is refused.

    Args:
        *args: ``transformers.Trainer``'s positional arguments.
        dp_args: The DP arguments.
        **kwargs: ``transformers.Trainer``'s keyword arguments.
    """
