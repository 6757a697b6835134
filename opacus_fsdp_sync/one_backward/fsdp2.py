"""Where the FSDP2 hand-off lived; it is now in :mod:`opacus_fsdp_sync.distributed.fsdp2`."""

from ..distributed.fsdp2 import FSDP2Handoff

__all__ = ["FSDP2Handoff"]
