"""Where the DDP hand-off lived; it is now in :mod:`opacus_fsdp_sync.distributed.ddp`."""

from ..distributed.ddp import DDPHandoff, all_reduce_mean, buckets

__all__ = ["DDPHandoff", "all_reduce_mean", "buckets"]
