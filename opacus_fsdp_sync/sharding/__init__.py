"""FSDP sharding helpers that produce layouts Opacus ghost clipping accepts."""

from .fsdp2 import mixed_precision_policy, shard_transformer

__all__ = ["mixed_precision_policy", "shard_transformer"]
