"""Where the per-API step controllers lived; each is now in its API's module.

:mod:`.single` (``NullController``), :mod:`.ddp`, :mod:`.fsdp1`, :mod:`.fsdp2`; their contract
is :class:`~.api.StepController`. :func:`make_controller` builds one through the API's record.
"""

from __future__ import annotations

from ..errors import UnsupportedConfigurationError
from .ddp import DDPController
from .detect import DistributedRoot
from .fsdp1 import FSDP1Controller
from .fsdp2 import FSDP2Controller
from .single import NullController


def make_controller(
    root: DistributedRoot, *, enabled: bool, keep_unsharded: bool = False, restricted: bool = False
):
    """Builds the controller of ``root``'s API (see :attr:`~.api.ApiRecord.make_controller`).

    Raises:
        UnsupportedConfigurationError: for a layout the step cannot run.
    """
    from .registry import record_for

    return record_for(root.api).make_controller(
        root.modules, enabled=enabled, keep_unsharded=keep_unsharded, restricted=restricted
    )


__all__ = [
    "DDPController",
    "FSDP1Controller",
    "FSDP2Controller",
    "NullController",
    "UnsupportedConfigurationError",
    "make_controller",
]
