"""One record per distributed API (single device, DDP, FSDP1, FSDP2, tensor parallelism alone).

Each module holds its API's step controller, one-backward hand-off, optimizer plan, layout check
and frozen :class:`~.api.ApiRecord`; :func:`~.registry.detect_api` returns a model's record and
:mod:`.plan` decides which hand-off a model made private gets. The records sit above the
mechanics (:mod:`opacus_fsdp_sync.distributed`) and the optimizers, and below the step.
"""

from .ddp import DDPController
from .fsdp2 import FSDP2Controller
from .single import NullController

__all__ = ["DDPController", "FSDP2Controller", "NullController"]
