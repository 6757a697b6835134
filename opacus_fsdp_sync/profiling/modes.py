"""Old path of the profiling suite's modes; they live in :mod:`opacus_fsdp_sync.bench.modes`.

A re-export shim so that ``from opacus_fsdp_sync.profiling.modes import MODES`` keeps working.
The core package does not import it at import time (``opacus_fsdp_sync.profiling`` forwards
``MODES``, ``ModeSpec`` and ``get_mode`` to it on first access).
"""

from ..bench.modes import MODES, ModeSpec, get_mode

__all__ = ["MODES", "ModeSpec", "get_mode"]
