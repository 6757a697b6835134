"""The trainer's model: a preset, a local checkpoint or an export; LoRA; sharded across ranks."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch
from torch import nn

from ..models import LlamaSpec, build_llama
from ..sharding import ShardingConfig, shard_model
from .config import TrainConfig

logger = logging.getLogger(__name__)

_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft():
    try:
        import peft
    except ImportError as err:
        raise ImportError("LoRA needs peft: pip install -e '.[lora]'") from err
    return peft


def apply_lora(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """LoRA adapters (peft) on every attention and MLP projection; the base weights frozen.

    Raises:
        ImportError: without peft (``pip install -e .[lora]``).
    """
    peft = _peft()
    task = "CAUSAL_LM" if cfg.task == "causal_lm" else "SEQ_CLS"
    lora = peft.LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=0.0,
        target_modules=_LORA_TARGETS,
        task_type=task,
    )
    return peft.get_peft_model(model, lora)


def is_adapter_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a peft adapter (``adapter_config.json``), not a full model."""
    return (Path(path) / "adapter_config.json").is_file()


def base_path(cfg: TrainConfig) -> str | None:
    """The directory the base weights come from.

    A full ``--init-from`` export, else ``--model-path`` (None: the preset, initialised from
    ``--seed``).
    """
    if cfg.init_from is not None and not is_adapter_dir(cfg.init_from):
        return cfg.init_from
    return cfg.model_path


def build_model(cfg: TrainConfig) -> tuple[nn.Module, object]:
    """The model to train, on the CPU, and a copy of its base model's ``config``.

    ``--init-from`` a full export loads it as the base; an adapter export is loaded on top of
    ``--model-path`` (or the preset): with ``--lora`` its adapters train on, without it they are
    merged into the base, whose weights then all train.

    Returns:
        ``(model, base_config)``; the config lets :mod:`.export` build a plain copy later.
    """
    spec = LlamaSpec(preset=cfg.model, task=cfg.task, model_path=base_path(cfg))
    torch.manual_seed(cfg.seed)
    model = build_llama(spec)
    base_config = copy.deepcopy(model.config)
    if cfg.init_from is not None and is_adapter_dir(cfg.init_from):
        peft = _peft()
        model = peft.PeftModel.from_pretrained(model, cfg.init_from, is_trainable=cfg.lora)
        if not cfg.lora:
            model = model.merge_and_unload()
        logger.info("[Ghost] init: adapter %s on %s", cfg.init_from, spec.model_path or cfg.model)
    elif cfg.lora:
        model = apply_lora(model, cfg)
    if cfg.init_from is not None and not is_adapter_dir(cfg.init_from):
        logger.info("[Ghost] init: %s", cfg.init_from)
    model.train()  # from_pretrained returns it in eval mode, which Opacus refuses
    return model, base_config


def shard(cfg: TrainConfig, model: nn.Module, device: torch.device, world: int) -> nn.Module:
    """The model sharded (or replicated) across ranks; on one process, as it is."""
    if world == 1:
        return model.to(device)
    precision = cfg.mixed_precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    if cfg.fsdp_api == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(device)
        return DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    sharding = ShardingConfig.for_precision(precision, strategy=cfg.strategy, backend=cfg.fsdp_api)
    return shard_model(model, sharding, device=device)


def load_tokenizer(cfg: TrainConfig):
    """The tokenizer of ``--init-from`` (a full export) or ``--model-path``.

    None for a preset or a directory without one (the byte tokenizer of :mod:`.data` serves).
    """
    from transformers import AutoTokenizer

    for source in dict.fromkeys([base_path(cfg), cfg.model_path]):
        if source is None:
            continue
        try:
            return AutoTokenizer.from_pretrained(source, local_files_only=True)
        except (OSError, ValueError):
            continue
    return None
