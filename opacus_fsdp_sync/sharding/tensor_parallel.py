"""Tensor parallelism for :func:`~opacus_fsdp_sync.sharding.shard_model` (``tp_degree > 1``).

Applied before activation checkpointing and ``fully_shard``, in torchtitan's order. The Llama
plan shards each decoder layer's attention and MLP projections: q/k/v and gate/up column-wise
(output features), o and down row-wise (input features), so each block's two all-reduces are
the only tp collectives of its forward. The embedding, the norms and the head stay replicated
over tp (their per-sample norms are counted once; see
:mod:`opacus_fsdp_sync.distributed.tensor_parallel`). Hugging Face's Llama attention reshapes
with ``-1`` heads, so each tp rank runs its own heads (query and key/value heads alike, which
keeps grouped-query attention's ratio).
"""

from __future__ import annotations

import logging

from torch import nn

from .config import ShardingConfig

logger = logging.getLogger(__name__)

#: Llama projection names and their style.
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")


def llama_tp_plan(model: nn.Module) -> dict:
    """``{module name: ParallelStyle}`` for every Llama projection in ``model``.

    Raises:
        ValueError: when the model has none (pass ``ShardingConfig.tp_plan`` then).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and last in COLWISE:
            plan[name] = ColwiseParallel()
        elif isinstance(module, nn.Linear) and last in ROWWISE:
            plan[name] = RowwiseParallel()
    if not plan:
        raise ValueError(
            f"{type(model).__name__} has no Llama projections ({', '.join(COLWISE + ROWWISE)}): "
            "pass ShardingConfig(tp_plan={module name: ColwiseParallel() or RowwiseParallel()})"
        )
    return plan


def apply_tensor_parallel(model: nn.Module, config: ShardingConfig, mesh) -> None:
    """``parallelize_module`` over ``mesh["tp"]`` with the config's plan (or the Llama plan)."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = config.tp_plan if config.tp_plan is not None else llama_tp_plan(model)
    parallelize_module(model, mesh["tp"], plan)
    logger.info(
        "[Ghost] tensor parallelism: %d layers over tp=%d (%s)",
        len(plan),
        config.tp_degree,
        ", ".join(sorted({type(s).__name__ for s in plan.values()})),
    )
