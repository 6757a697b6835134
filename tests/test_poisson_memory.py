"""Peak memory under Poisson sampling: ``BatchMemoryManager`` bounds it by the physical batch.

Measured by :mod:`opacus_fsdp_sync.bench.poisson_memory` (the op ledger's live tensor bytes made
inside each logical step) on FSDP2 with one gloo rank. The draws are pinned by ``dp_seed``, so
that the whole-draw and the split runs see the same logical batches and every draw exceeds the
physical batch (this test is about memory, not about the draws' privacy).
"""

from __future__ import annotations

import math

import pytest

from opacus_fsdp_sync.bench.poisson_memory import PoissonMemoryConfig, markdown, parse_args
from opacus_fsdp_sync.testing import run_ranks

CFG = dict(
    preset="tiny",
    width_divisor=1,
    blocks=1,
    seq_length=16,
    dataset_size=64,
    expected_batch=16,
    max_physical=4,
    steps=2,
    dp_seed=7,
)


def _measure(rank: int, world: int) -> dict:
    from opacus_fsdp_sync.bench.poisson_memory import run

    return run(PoissonMemoryConfig(**CFG))


@pytest.mark.distributed
def test_memory_manager_bounds_the_peak_by_the_physical_batch():
    (result,) = run_ranks(_measure, 1, timeout=300)
    fixed = result["fixed_batch"]
    whole = result["poisson"]["without_memory_manager"]
    split = result["poisson"]["with_memory_manager"]
    assert len(whole) == len(split) == CFG["steps"]
    assert [s["examples"] for s in whole] == [s["examples"] for s in split]  # same draws
    for w, s in zip(whole, split):
        assert w["physical"] == 1
        assert s["physical"] == math.ceil(s["examples"] / CFG["max_physical"]) > 1
        # the whole draw holds every example's activations at once: above the fixed batch
        assert w["peak_bytes"] > fixed["private_peak_bytes"]
        # split: a physical batch's step (at most max_physical examples), whatever the draw
        assert s["peak_bytes"] <= 1.15 * fixed["private_peak_bytes"]
        assert s["peak_bytes"] < w["peak_bytes"]
    assert fixed["private_peak_bytes"] <= 1.15 * fixed["non_private_peak_bytes"]
    table = markdown(result)
    assert table.count("| Poisson, BatchMemoryManager |") == CFG["steps"]


def test_config_validates_and_maps_flags():
    cfg = parse_args(["--expected-batch", "32", "--dataset-size", "64", "--dp-seed", "3"])
    assert cfg.expected_batch == 32 and cfg.dp_seed == 3
    assert parse_args([]).dp_seed is None  # OS entropy unless asked
    with pytest.raises(ValueError, match="sample rate"):
        PoissonMemoryConfig(dataset_size=8, expected_batch=16)
    with pytest.raises(ValueError, match="max_physical"):
        PoissonMemoryConfig(max_physical=0)
