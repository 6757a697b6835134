"""``python -m opacus_fsdp_sync.train``: DP fine-tuning under FSDP2, FSDP1 or DDP."""

from .config import TrainConfig, parse_args
from .loop import train

__all__ = ["TrainConfig", "parse_args", "train"]
