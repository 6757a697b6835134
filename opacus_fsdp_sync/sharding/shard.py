"""``shard_model``: the one entry point from a :class:`ShardingConfig` to a sharded model."""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..distributed.env import pick_device_and_backend
from ..layers.tied import find_shared_parameters
from .config import ShardingConfig
from .fsdp1 import shard_fsdp1
from .fsdp2 import build_mesh, shard_fsdp2
from .tensor_parallel import apply_tensor_parallel
from .wrap import find_blocks

logger = logging.getLogger(__name__)


def _apply_activation_checkpointing(model: nn.Module, config: ShardingConfig) -> None:
    """Non-reentrant recomputation of each block.

    Uses Hugging Face's own switch when the model has one (its layers handle their keyword
    arguments), else torch's checkpoint wrapper on each block.
    """
    if hasattr(model, "gradient_checkpointing_enable") and config.block_classes is None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    blocks = {id(b) for b in find_blocks(model, config.block_classes)}
    apply_activation_checkpointing(model, check_fn=lambda m: id(m) in blocks)


def shard_model(
    model: nn.Module, config: ShardingConfig | None = None, *, device: torch.device | None = None
) -> nn.Module:
    """Shards ``model`` in place as ``config`` says (process group already initialised).

    Args:
        model: An unsharded model, on ``device`` or on CPU.
        config: The sharding configuration (default: FSDP2, ``full``, ``transformer``).
        device: Where computation runs; default CUDA when available, else CPU.

    Returns:
        The sharded model (FSDP2: the same object; FSDP1: the wrapping instance).

    Raises:
        ValueError: for a shared weight with ``tied_weights="refuse"``, for CPU offload on a
            machine without CUDA, or for an option the backend lacks.
    """
    config = config or ShardingConfig()
    if device is None:
        device = torch.device(pick_device_and_backend()[0])
    shared = find_shared_parameters(model)
    if shared and config.tied_weights == "refuse":
        users = "; ".join(" + ".join(o[0] for o in s.owners) for s in shared)
        raise ValueError(
            f"The model shares weights ({users}) and tied_weights='refuse'. Untie them (for a "
            "Hugging Face model: config.tie_word_embeddings=False before building), or use "
            "tied_weights='shard_together' (exact per-sample norms are computed for them)."
        )
    if config.cpu_offload and device.type != "cuda":
        raise ValueError(
            "cpu_offload=True needs a CUDA device (on the CPU the parameters already live in "
            "host memory); set cpu_offload=False."
        )
    mesh = None
    if config.tp_degree > 1:  # torchtitan's order: TP, activation checkpointing, fully_shard
        mesh = build_mesh(config, device.type)
        apply_tensor_parallel(model, config, mesh)
    if config.activation_checkpointing:
        _apply_activation_checkpointing(model, config)
    sharded = (
        shard_fsdp2(model, config, mesh)
        if mesh is not None
        else _SHARDERS[config.backend](model, config, device)
    )
    logger.info(
        "[Ghost] sharded %s: backend=%s strategy=%s wrap=%s%s",
        type(model).__name__,
        config.backend,
        config.strategy,
        config.wrap_policy,
        f", shared weights kept in one unit: {len(shared)}" if shared else "",
    )
    return sharded


def _fsdp1(model: nn.Module, config: ShardingConfig, device: torch.device) -> nn.Module:
    """FSDP1; a device mesh only for HYBRID_SHARD."""
    mesh = build_mesh(config, device.type) if config.strategy == "hybrid_full" else None
    return shard_fsdp1(model, config, device, mesh)


def _fsdp2(model: nn.Module, config: ShardingConfig, device: torch.device) -> nn.Module:
    """FSDP2 on the strategy's mesh (1-D, or 2-D for HSDP)."""
    return shard_fsdp2(model, config, build_mesh(config, device.type))


#: The sharding function of each ``ShardingConfig.backend``.
_SHARDERS = {"fsdp1": _fsdp1, "fsdp2": _fsdp2}
