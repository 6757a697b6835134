"""DP optimizers our engine swaps in where the distributed API already reduced gradients."""

from .shared_noise import SharedNoiseDPOptimizer

__all__ = ["SharedNoiseDPOptimizer"]
