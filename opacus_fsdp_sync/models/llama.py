"""Llama architectures from ``transformers.LlamaConfig`` with random weights (no download).

Presets: ``llama3.2-1b`` (the released shape, tied embeddings), ``small`` and ``tiny`` for CPU.
A local checkpoint directory can be loaded instead with ``model_path``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)

TASKS = ("causal_lm", "seq_cls")

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

#: LlamaConfig keyword arguments per preset.
PRESETS: dict[str, dict] = {
    "llama3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        vocab_size=2048,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    ),
}


@dataclass(kw_only=True)
class LlamaSpec:
    """What model to build.

    Attributes:
        preset: One of :data:`PRESETS`; ignored when ``model_path`` is set.
        task: ``"causal_lm"`` (LlamaForCausalLM) or ``"seq_cls"``
            (LlamaForSequenceClassification, Opacus's own Llama example).
        tie_word_embeddings: None keeps the preset's choice; True/False forces it.
        num_labels: Classes for ``seq_cls``.
        model_path: A local checkpoint directory to load instead of random weights.
        dtype: Parameter dtype at construction.
    """

    preset: str = "tiny"
    task: str = "causal_lm"
    tie_word_embeddings: bool | None = None
    num_labels: int = 2
    model_path: str | None = None
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.model_path is None and self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r}: choose one of {sorted(PRESETS)}")
        if self.task not in TASKS:
            raise ValueError(f"task={self.task!r}: choose one of {TASKS}")


def llama_config(spec: LlamaSpec):
    """The ``LlamaConfig`` of a spec (eager attention, so Opacus's hooks see every op)."""
    from transformers import LlamaConfig

    kwargs = dict(PRESETS[spec.preset])
    if spec.tie_word_embeddings is not None:
        kwargs["tie_word_embeddings"] = spec.tie_word_embeddings
    cfg = LlamaConfig(**kwargs, num_labels=spec.num_labels, attn_implementation="eager")
    cfg.pad_token_id = 0
    return cfg


def build_llama(spec: LlamaSpec) -> nn.Module:
    """Builds the model of ``spec`` on the current default device.

    Use ``torch.device("meta")`` as a context manager to build without allocating memory.
    """
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    cls = LlamaForCausalLM if spec.task == "causal_lm" else LlamaForSequenceClassification
    if spec.model_path is not None:
        model = cls.from_pretrained(spec.model_path, torch_dtype=spec.dtype, local_files_only=True)
    else:
        model = cls(llama_config(spec)).to(spec.dtype)
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = 0
    return model


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of a Llama model (``model.model.layers``)."""
    return list(model.model.layers)
