"""Clients that bring the engine to other training frameworks.

:mod:`.transformers`: Hugging Face ``Trainer`` (``DPTrainer``, extra ``[hf]``) and TRL's
``SFTTrainer`` (``DPSFTTrainer``, extra ``[trl]``). The core never imports this package.
"""
