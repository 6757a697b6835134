"""The low mechanics of distributed training: detection, torch's private state, DTensor rules.

Everything here reads torch (which wrapper is where, FSDP's and DDP's private attributes behind
the version gate, tensor parallelism's placements) and imports nothing of the package above it:
the per-API records (:mod:`opacus_fsdp_sync.apis`), the optimizers and the step import this.
"""

from ..errors import UnsupportedConfigurationError
from ._ddp_internals import DDPInternalsError
from ._fsdp2_internals import FSDPInternalsError
from .detect import DDP, FSDP1, FSDP2, DistributedRoot, _get_fsdp_root_module, get_fsdp_root_module
from .version_gate import TESTED_TORCH_VERSIONS, TorchInternalsError

__all__ = [
    "DDP",
    "FSDP1",
    "FSDP2",
    "DDPInternalsError",
    "DistributedRoot",
    "FSDPInternalsError",
    "TESTED_TORCH_VERSIONS",
    "TorchInternalsError",
    "UnsupportedConfigurationError",
    "_get_fsdp_root_module",
    "get_fsdp_root_module",
]
