"""Sharding with FSDP2 (``fully_shard``) from a :class:`ShardingConfig`."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from .config import ShardingConfig
from .wrap import units


def build_mesh(config: ShardingConfig, device_type: str):
    """The device mesh of a strategy: 1-D for full/shard_grad_op, 2-D otherwise.

    With ``tp_degree > 1`` a last dimension ``"tp"`` is added and the data-parallel ones are
    named as torchtitan names them: ``("dp_shard", "tp")``, or ``("dp_replicate", "dp_shard",
    "tp")`` for ``hybrid_full``; :func:`data_parallel_mesh` is what ``fully_shard`` takes.

    Raises:
        ValueError: when the world size does not fit ``replicate_degree`` or ``tp_degree``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    tp = config.tp_degree
    if world % tp:
        raise ValueError(
            f"tp_degree={tp} does not divide the world size {world}; choose a divisor of the "
            "number of processes."
        )
    dp = world // tp
    if config.strategy in ("full", "shard_grad_op"):
        if tp > 1:
            return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp_shard", "tp"))
        return init_device_mesh(device_type, (world,))
    if config.strategy == "no_shard":
        return init_device_mesh(device_type, (world, 1), mesh_dim_names=("replicate", "shard"))
    replicas = config.replicate_degree or (2 if dp % 2 == 0 and dp > 1 else 1)
    if dp % replicas:
        raise ValueError(
            f"replicate_degree={replicas} does not divide the data-parallel size {dp} (world "
            f"{world} / tp_degree {tp}); choose a divisor."
        )
    if tp > 1:
        return init_device_mesh(
            device_type,
            (replicas, dp // replicas, tp),
            mesh_dim_names=("dp_replicate", "dp_shard", "tp"),
        )
    return init_device_mesh(
        device_type, (replicas, dp // replicas), mesh_dim_names=("replicate", "shard")
    )


def data_parallel_mesh(mesh):
    """The (sub)mesh ``fully_shard`` shards over: ``mesh`` without its ``"tp"`` dimension."""
    names = mesh.mesh_dim_names or ()
    if "tp" not in names:
        return mesh
    dp = tuple(n for n in names if n != "tp")
    return mesh[dp if len(dp) > 1 else dp[0]]


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
        mesh=data_parallel_mesh(mesh),
        reshard_after_forward=config.strategy != "shard_grad_op",
        mp_policy=MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce, output_dtype=output),
        offload_policy=CPUOffloadPolicy() if config.cpu_offload else OffloadPolicy(),
    )
    for unit in units(model, config):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model
