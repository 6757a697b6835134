"""Shard-local noise on FSDP2 units that sit on different meshes (a 1-D mesh beside HSDP).

Each rank draws its shards' noise from streams named by a key. Equal keys must mean replicas
of the same shards: a key made of mesh coordinates alone gave rank 2's HSDP shard and rank 0's
flat-mesh shard one key with different members, so the same Gaussian draws landed on two
different coordinates of the global gradient (66,857 of 75,268 values reused) and the HSDP
replicas, drawing at different offsets, drifted apart.
"""

from __future__ import annotations

import pytest
import torch

from opacus_fsdp_sync.testing import run_ranks
from tests import workers_noise_keys as wk

WORLD = 4


def _distinct_shards(results: list[dict], case: str, replica: int) -> list[torch.Tensor]:
    """The noise of every distinct global shard once: HSDP's from replica ``replica`` only."""
    out = []
    for rank in range(WORLD):
        for entry in results[rank][case].values():
            if entry["mesh"] == (2, WORLD // 2) and entry["coordinate"][0] != replica:
                continue
            out.append(entry["noise"])
    return out


@pytest.mark.distributed
def test_mixed_mesh_noise_is_independent_across_shards_and_equal_on_replicas():
    results = run_ranks(wk.mixed_meshes, WORLD, timeout=300)
    for case in wk.CASES:
        for replica in (0, 1):
            values = torch.cat(_distinct_shards(results, case, replica))
            repeated = values.numel() - torch.unique(values).numel()
            # Independent float32 Gaussians repeat a value by chance a few dozen times here.
            assert repeated < values.numel() // 100, (case, replica, repeated, values.numel())
        for rank in range(WORLD):
            for name, entry in results[rank][case].items():
                if entry["mesh"] != (2, WORLD // 2) or entry["coordinate"][0] != 0:
                    continue
                replica = results[rank + WORLD // 2][case][name]
                assert replica["coordinate"][1] == entry["coordinate"][1]
                assert torch.equal(replica["noise"], entry["noise"]), (case, name, rank)
                assert torch.equal(replica["after"], entry["after"]), (case, name, rank)


@pytest.mark.distributed
def test_meshes_of_one_shape_draw_independent_noise_for_their_parameters():
    """Ranks 0 and 1 hold coordinate 0 of two different meshes of one shape: the stream keys
    agree, and only the parameters each stream covers keep their draws apart."""
    results = run_ranks(wk.same_shape_meshes, 2, timeout=300)
    values = torch.cat([e["noise"] for res in results for e in res["reversed"].values()])
    repeated = values.numel() - torch.unique(values).numel()
    assert values.numel() > 10_000
    assert repeated < values.numel() // 100, (repeated, values.numel())
