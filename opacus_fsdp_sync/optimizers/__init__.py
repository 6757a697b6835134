"""DP optimizers our engine swaps in where the distributed API already reduced gradients."""

from .fsdp1 import FSDP1DPOptimizer
from .fsdp2 import DataParallelFSDPOptimizer, ShardedNoiseFSDPOptimizer
from .shared_noise import SharedNoiseDPOptimizer

__all__ = [
    "DataParallelFSDPOptimizer",
    "FSDP1DPOptimizer",
    "SharedNoiseDPOptimizer",
    "ShardedNoiseFSDPOptimizer",
]
