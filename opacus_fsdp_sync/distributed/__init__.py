"""Distributed-API detection and the per-API gradient-sync controllers."""

from ..errors import UnsupportedConfigurationError
from ._ddp_internals import DDPInternalsError
from ._fsdp2_internals import FSDPInternalsError
from .ddp import DDPController
from .detect import DDP, FSDP1, FSDP2, DistributedRoot, _get_fsdp_root_module, get_fsdp_root_module
from .fsdp2 import FSDP2Controller
from .single import NullController
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
]
