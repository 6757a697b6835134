"""Distributed-API detection and the per-API gradient-sync controllers."""

from ._ddp_internals import DDPInternalsError
from ._fsdp2_internals import FSDPInternalsError
from .controllers import (
    DDPController,
    FSDP2Controller,
    NullController,
    UnsupportedConfigurationError,
    make_controller,
)
from .detect import DDP, FSDP1, FSDP2, DistributedRoot, _get_fsdp_root_module, get_fsdp_root_module
from .version_gate import TESTED_TORCH_VERSIONS, TorchInternalsError

__all__ = [
    "DDP",
    "FSDP1",
    "FSDP2",
    "DDPController",
    "DDPInternalsError",
    "DistributedRoot",
    "FSDP2Controller",
    "FSDPInternalsError",
    "NullController",
    "TESTED_TORCH_VERSIONS",
    "TorchInternalsError",
    "UnsupportedConfigurationError",
    "_get_fsdp_root_module",
    "get_fsdp_root_module",
    "make_controller",
]
