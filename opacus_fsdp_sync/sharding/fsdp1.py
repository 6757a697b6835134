"""Sharding with FSDP1 (``FullyShardedDataParallel``, ``use_orig_params=True``)."""

from __future__ import annotations

import torch
from torch import nn

from .config import ShardingConfig
from .wrap import units

_STRATEGY = {
    "full": "FULL_SHARD",
    "shard_grad_op": "SHARD_GRAD_OP",
    "hybrid_full": "HYBRID_SHARD",
    "no_shard": "NO_SHARD",
}


def shard_fsdp1(model: nn.Module, config: ShardingConfig, device: torch.device, mesh=None):
    """Wraps the units chosen by the wrap policy and the root in ``FullyShardedDataParallel``.

    Raises:
        ValueError: for ``output_dtype`` (FSDP1 has no output casting).
    """
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if config.output_dtype is not None:
        raise ValueError(
            "output_dtype is not available with backend='fsdp1' (FSDP1 cannot cast unit "
            "outputs); leave it None or use backend='fsdp2'."
        )
    chosen = {id(m) for m in units(model, config)}

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return True if recurse else id(module) in chosen

    strategy = config.strategy
    if strategy == "hybrid_full" and mesh is not None and mesh.size(-1) == 1:
        # Shard groups of one rank: FSDP1 turns HYBRID_SHARD into NO_SHARD but keeps the
        # one-rank group, so nothing would be all-reduced. Plain NO_SHARD is what was meant.
        strategy, mesh = "no_shard", None
    param, reduce, _ = config.dtypes()
    mixed = None
    if param is not None or reduce is not None:
        mixed = MixedPrecision(param_dtype=param, reduce_dtype=reduce, buffer_dtype=param)
    return FSDP(
        model,
        auto_wrap_policy=policy,
        sharding_strategy=ShardingStrategy[_STRATEGY[strategy]],
        mixed_precision=mixed,
        cpu_offload=CPUOffload(offload_params=True) if config.cpu_offload else None,
        device_id=device,
        use_orig_params=True,
        device_mesh=mesh if strategy == "hybrid_full" else None,
    )
