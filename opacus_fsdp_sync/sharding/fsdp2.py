"""Sharding with FSDP2 (``fully_shard``) from a :class:`ShardingConfig`."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from .config import ShardingConfig
from .wrap import units


def build_mesh(config: ShardingConfig, device_type: str):
    """The device mesh of a strategy: 1-D for full/shard_grad_op, 2-D otherwise.

    Raises:
        ValueError: when the world size does not fit ``replicate_degree``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if config.strategy in ("full", "shard_grad_op"):
        return init_device_mesh(device_type, (world,))
    if config.strategy == "no_shard":
        return init_device_mesh(device_type, (world, 1), mesh_dim_names=("replicate", "shard"))
    replicas = config.replicate_degree or (2 if world % 2 == 0 and world > 1 else 1)
    if world % replicas:
        raise ValueError(
            f"replicate_degree={replicas} does not divide the world size {world}; choose a "
            "divisor of the number of processes."
        )
    return init_device_mesh(
        device_type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard")
    )


def shard_fsdp2(model: nn.Module, config: ShardingConfig, mesh) -> nn.Module:
    """Applies ``fully_shard`` to each unit chosen by the wrap policy, then to the root."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    param, reduce, output = config.dtypes()
    kwargs = dict(
        mesh=mesh,
        reshard_after_forward=config.strategy != "shard_grad_op",
        mp_policy=MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce, output_dtype=output),
        offload_policy=CPUOffloadPolicy() if config.cpu_offload else OffloadPolicy(),
    )
    for unit in units(model, config):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model
