"""Moved to :mod:`opacus_fsdp_sync.layers.linear_grams` (this name is kept for old imports)."""

from .layers.linear_grams import (
    AUTO_BLOCK_ACCELERATOR,
    AUTO_BLOCK_CPU,
    contract_output_grams,
    describe_block,
    flop_fraction,
    resolve_block,
    row_blocks,
    upper_gram,
    widen,
)

__all__ = [
    "AUTO_BLOCK_ACCELERATOR",
    "AUTO_BLOCK_CPU",
    "contract_output_grams",
    "describe_block",
    "flop_fraction",
    "resolve_block",
    "row_blocks",
    "upper_gram",
    "widen",
]
