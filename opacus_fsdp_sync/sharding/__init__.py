"""DP-aware sharding: a typed config, ``shard_model``, wrap policies and sharded checkpoints."""

from .checkpoint import load_checkpoint, save_checkpoint
from .config import BACKENDS, STRATEGIES, WRAP_POLICIES, ShardingConfig
from .dp_state import CheckpointMismatchError
from .fsdp2 import build_mesh
from .shard import shard_model
from .wrap import find_blocks, units

__all__ = [
    "BACKENDS",
    "CheckpointMismatchError",
    "STRATEGIES",
    "WRAP_POLICIES",
    "ShardingConfig",
    "build_mesh",
    "find_blocks",
    "load_checkpoint",
    "save_checkpoint",
    "shard_model",
    "units",
]
