"""Tensor parallelism alone (1-D TP: ``parallelize_module`` without ``fully_shard``).

Every rank is one tp rank of a single data-parallel group: all take the same examples (the
shared Poisson draw whole), the per-sample norms of tp-sharded parameters are summed over the
tp group (:mod:`.tensor_parallel`), and the optimizer draws each tp shard's own noise and the
same noise for parameters replicated over tp. Nothing averages gradients over ranks. There is
no gradient sync to skip in the first pass (the tp collectives of the backward carry the
activations' gradients); one backward hands each parameter its clipped gradient's tp shard
as a DTensor.
"""

from __future__ import annotations

import functools

import torch.distributed as dist
from torch import nn

from ..distributed.tensor_parallel import check_names, on_tp_mesh, tp_group
from ..errors import UnsupportedConfigurationError
from .api import TP, ApiRecord, Capabilities
from .single import NullController, SingleDeviceHandoff


def _controller(modules: list[nn.Module], **_) -> NullController:
    controller = NullController()
    controller.api = TP
    return controller


def _handoff(modules: list[nn.Module]) -> SingleDeviceHandoff:
    """The single-device hand-off: ``p.grad``, each tp shard as a DTensor, no collective."""
    return SingleDeviceHandoff()


def _sharded(inner, *, generator, secure_mode: bool, dp_degree: int, **kwargs):
    from ..optimizers import ShardedNoiseFSDPOptimizer

    return ShardedNoiseFSDPOptimizer(
        inner, generator=generator, secure_mode=secure_mode, dp_degree=dp_degree, **kwargs
    )


def _plan_optimizer(modules, *, options, secure_mode: bool, grad_sample_mode: str, layout):
    """Per-placement noise (tp shards independent, tp-replicated parameters shared).

    Raises:
        UnsupportedConfigurationError: with ``secure_mode`` (no per-shard secure draw yet).
    """
    if secure_mode:
        raise UnsupportedConfigurationError(
            "secure_mode with tensor parallelism: the per-shard noise has no secure draw yet; "
            "run without secure_mode or without parallelize_module."
        )
    return functools.partial(_sharded, dp_degree=layout.dp_degree)  # 1: one data-parallel group


def _check_layout(model: nn.Module, modules: list[nn.Module]) -> None:
    """Refuses unnamed tp meshes and tp groups smaller than the world (use fully_shard then)."""
    check_names(model)
    on_tp = [p for p in model.parameters() if on_tp_mesh(p)]
    degree = dist.get_world_size(tp_group(on_tp[0]))
    if degree != dist.get_world_size():
        raise UnsupportedConfigurationError(
            f"tensor parallelism over {degree} of {dist.get_world_size()} ranks without FSDP2: "
            "the other ranks' data parallelism is unmanaged. Call fully_shard over the "
            "data-parallel mesh dimension after parallelize_module."
        )


RECORD = ApiRecord(
    name=TP,
    title="tensor-parallel",
    capabilities=Capabilities(distributed=True, sharded=True, ghost_modes=("ghost_fsdp",)),
    make_controller=_controller,
    make_handoff=_handoff,
    plan_optimizer=_plan_optimizer,
    check_layout=_check_layout,
)
