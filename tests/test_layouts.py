"""Every sharding layout is calibrated (noise sigma C / B per coordinate, the loop's update) or
refused at ``make_private`` with a message that says how to shard it.

Poisson sampling is off here: the test compares two steps on one fixed batch (noise 0 and 1),
which a Poisson draw would make differ.
"""

import pytest
import torch

from opacus_fsdp_sync.testing import run_ranks
from tests import workers_layouts as wl

pytestmark = [pytest.mark.distributed]


def _check(results, api, world, secure=False):
    b = wl.B_LOCAL * world
    assert (results[0]["norms"] > wl.C).sum() >= 2, results[0]["norms"]  # clipping active
    for layout, calibrated in wl.LAYOUTS[api].items():
        if secure and layout not in wl.SECURE:
            continue
        per_rank = [r[layout] for r in results]
        if not calibrated:
            for r in per_rank:
                assert r["refused"] is not None, (layout, "accepted")
                assert r["hooks"] == 0, (layout, "left hooks on the model")
            continue
        r0 = per_rank[0]
        assert r0["refused"] is None, (layout, r0["refused"])
        for r in per_rank:
            # exact against the clip-each-sample loop with noise 0
            assert r["vs_loop"] <= 1e-6 * max(1.0, r["update"]), (layout, r["vs_loop"])
            # replicas agree: every rank ends with the same full parameters
            assert torch.equal(r["noise"], r0["noise"]), layout
        z = r0["noise"]
        assert z.numel() >= 50_000
        ratio = z.std().item() / (wl.SIGMA * wl.C / b)
        assert abs(ratio - 1.0) < 0.02, (layout, ratio)
        assert abs(z.mean().item()) < 0.02 * wl.SIGMA * wl.C / b
        # independent across shards: identically seeded ranks, other draws
        if api != "ddp" and layout not in wl.REPLICATED:
            for r in per_rank[1:]:
                k = min(r0["local_noise"].numel(), r["local_noise"].numel())
                a, c = r0["local_noise"][:k], r["local_noise"][:k]
                assert k > 10_000 and abs(torch.corrcoef(torch.stack([a, c]))[0, 1]) < 0.05


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("api", ["fsdp2", "fsdp1", "ddp"])
def test_every_layout_is_calibrated_or_refused(api, world):
    _check(run_ranks(wl.layouts, world, api, timeout=600), api, world)


def test_unmanaged_trainable_parameters_are_refused_before_anything_is_wrapped():
    for res in run_ranks(wl.unmanaged_parameters, 2, timeout=300):
        for path, (message, hooks) in res.items():
            assert message is not None and "l3.weight" in message, (path, message)
            assert "fully_shard" in message, (path, message)
            assert hooks == 0, path


@pytest.mark.parametrize("api", ["fsdp2", "fsdp1", "ddp"])
def test_secure_mode_noise_is_calibrated(api):
    """Opacus's optimizers and secure draws (FSDP1: our secure shard noise and its scaling)."""
    _check(run_ranks(wl.layouts, 2, api, True, timeout=600), api, 2, secure=True)
