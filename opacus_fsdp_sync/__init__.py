"""opacus-fsdp-sync: Opacus ghost clipping under FSDP without first-pass gradient sync.

Switch one import::

    from opacus_fsdp_sync import PrivacyEngine
"""

from .backward import SyncDPLoss, SyncDPTensor
from .distributed import (
    FSDPInternalsError,
    UnsupportedConfigurationError,
    _get_fsdp_root_module,
    get_fsdp_root_module,
)
from .privacy_engine import PrivacyEngine
from .profiling import CollectiveCounter, StepTimer, phase

__version__ = "0.1.0"

__all__ = [
    "CollectiveCounter",
    "FSDPInternalsError",
    "PrivacyEngine",
    "StepTimer",
    "SyncDPLoss",
    "SyncDPTensor",
    "UnsupportedConfigurationError",
    "_get_fsdp_root_module",
    "get_fsdp_root_module",
    "phase",
]
