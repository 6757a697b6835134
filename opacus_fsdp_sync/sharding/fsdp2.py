"""Sharding a transformer with FSDP2 the way ghost clipping accepts and runs fast."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def mixed_precision_policy(kind: str):
    """``"bf16"``: bf16 parameters, fp32 gradient reduction; ``"fp32"``: no casting.

    Raises:
        ValueError: for any other kind.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if kind == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if kind == "fp32":
        return MixedPrecisionPolicy()
    raise ValueError(f"mixed_precision={kind!r}: choose 'bf16' or 'fp32'")


def shard_transformer(
    model: nn.Module, blocks: Sequence[nn.Module], mesh, *, mixed_precision: str = "fp32"
) -> nn.Module:
    """One FSDP2 unit per transformer block plus the root.

    The root unit owns everything outside the blocks, so a weight tied between the input
    embedding and the output head lives in one group (FSDP2 refuses a parameter in two groups).

    Args:
        model: The model to shard in place.
        blocks: Its transformer blocks (e.g. ``model.model.layers``).
        mesh: A 1-D device mesh.
        mixed_precision: ``"fp32"`` or ``"bf16"`` (see :func:`mixed_precision_policy`).

    Returns:
        The sharded model (the same object).
    """
    from torch.distributed.fsdp import fully_shard

    mp = mixed_precision_policy(mixed_precision)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model
