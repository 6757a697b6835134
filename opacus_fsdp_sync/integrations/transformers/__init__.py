"""DP fine-tuning from Hugging Face ``Trainer`` and TRL ``SFTTrainer``.

``DPTrainer`` (extra ``[hf]``: transformers, accelerate) and ``DPSFTTrainer`` (extra ``[trl]``)
take the Trainer's arguments unchanged plus one :class:`DPArguments`. See ``docs/hf.md``.
Module map: :mod:`.arguments` (the DP arguments), :mod:`.refusals` (what is refused, batch
mapping), :mod:`.session` (making the prepared model private), :mod:`.batches` (logical and
physical batches of the shared Poisson draw), :mod:`.loss` (per-example losses),
:mod:`.checkpoints` (DP state in checkpoints, saved models), :mod:`.mixin` (the Trainer
overrides), :mod:`.trainer` and :mod:`.trl` (the two classes).
"""

from __future__ import annotations

from .arguments import DPArguments

__all__ = ["DPArguments", "DPSFTTrainer", "DPTrainer"]


def __getattr__(name: str):
    if name == "DPTrainer":
        from .trainer import DPTrainer

        return DPTrainer
    if name == "DPSFTTrainer":
        from .trl import DPSFTTrainer

        return DPSFTTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
