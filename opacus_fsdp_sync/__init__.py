"""opacus-fsdp-sync: Opacus ghost clipping under FSDP without first-pass gradient sync.

Switch one import::

    from opacus_fsdp_sync import PrivacyEngine
"""

from ._opacus_internals import abandon_step
from .backward import SyncDPLoss, SyncDPTensor
from .distributed import (
    TESTED_TORCH_VERSIONS,
    FSDPInternalsError,
    TorchInternalsError,
    UnsupportedConfigurationError,
    _get_fsdp_root_module,
    get_fsdp_root_module,
)
from .distributed.version_gate import warn_if_untested as _warn_if_untested
from .privacy_engine import PrivacyEngine
from .profiling import CollectiveCounter, StepTimer, phase

__version__ = "0.1.0"

_warn_if_untested()

__all__ = [
    "CollectiveCounter",
    "FSDPInternalsError",
    "PrivacyEngine",
    "StepTimer",
    "SyncDPLoss",
    "SyncDPTensor",
    "TESTED_TORCH_VERSIONS",
    "TorchInternalsError",
    "UnsupportedConfigurationError",
    "_get_fsdp_root_module",
    "abandon_step",
    "get_fsdp_root_module",
    "phase",
]
