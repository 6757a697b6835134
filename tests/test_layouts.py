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


def test_secure_mode_is_refused_where_fsdp2_ranks_hold_replicas():
    """Opacus's secure optimizer draws each rank's noise from its own ``/dev/urandom``: on
    replicated coordinates (HSDP's replicate dimension, torch's FSDP-based ``replicate``) the
    replicas would drift apart, each averaging the others' independent noise."""
    for res in run_ranks(wl.secure_replicas, 2, timeout=300):
        for layout, (message, hooks) in res.items():
            assert message is not None, (layout, "accepted")
            assert message.startswith("UnsupportedConfigurationError"), message
            assert "replicated over ranks" in message and "secure_mode" in message, message
            assert hooks == 0, layout


@pytest.mark.parametrize("api", ["fsdp2", "fsdp1", "ddp"])
def test_secure_mode_noise_is_calibrated(api):
    """Opacus's optimizers and secure draws (FSDP1: our secure shard noise and its scaling)."""
    _check(run_ranks(wl.layouts, 2, api, True, timeout=600), api, 2, secure=True)


def _refused(results, layouts, modes):
    for res in results:
        for layout in layouts:
            for mode in modes:
                r = res[layout, mode]
                assert r["refused"] is not None, (layout, mode, "accepted")
                assert r["refused"].startswith("UnsupportedConfigurationError"), r["refused"]
                assert r["hooks"] == 0 and r["same_forward"], (layout, mode, r)
    return results[0]


MODES = ("ghost", "ghost_fsdp", "hooks")


def test_ddp_based_composable_replicate_is_refused_before_anything_is_wrapped():
    """torch's DDP-based ``replicate`` looks like one process to Opacus (replicas diverge)."""
    layouts = ("replicate_ddp", "replicate_ddp_inner")
    res = _refused(
        run_ranks(wl.refused_parallelism, 2, layouts, MODES, timeout=300), layouts, MODES
    )
    for mode in MODES:
        root, inner = (
            res["replicate_ddp", mode]["refused"],
            res["replicate_ddp_inner", mode]["refused"],
        )
        for message in (root, inner):
            assert "replicate" in message and "DistributedDataParallel" in message, message
            assert "fully_shard" in message, message
        assert "the model itself" in root, root
        assert "l2" in inner, inner


def test_tensor_parallelism_is_refused_where_it_is_not_calibrated():
    """Opacus's own modes refuse every TP layout (their norm hooks would mix DTensors and local
    tensors); ``ghost_fsdp`` refuses FSDP's ``replicate`` over TP and an unnamed tp dimension,
    and accepts TP alone and under ``fully_shard`` (exact: ``tests/test_tp.py``)."""
    layouts = (
        "tp",
        "tp_fsdp_1x2",
        "tp_fsdp_2x1",
        "tp_fsdp_root_1x2",  # FSDP2's (dp, tp) placements are not shown while unsharded
        "tp_replicate_1x2",
        "tp_replicate_2x1",
    )
    modes = ("hooks",)
    res = _refused(
        run_ranks(wl.refused_parallelism, 2, layouts, modes, timeout=300), layouts, modes
    )
    for layout in layouts:
        message = res[layout, "hooks"]["refused"]
        assert "tensor parallel" in message and "not supported" in message, message
        assert "l1.weight" in message and "Shard(dim=0)" in message, message
        assert "'tp'" in message, message  # the mesh dimension's name
    refused = ("tp_replicate_1x2", "tp_replicate_2x1", "tp_unnamed")
    res = _refused(
        run_ranks(wl.refused_parallelism, 2, refused, ("ghost_fsdp",), timeout=300),
        refused,
        ("ghost_fsdp",),
    )
    for layout in refused[:2]:
        message = res[layout, "ghost_fsdp"]["refused"]
        assert "tensor parallel" in message and "fully_shard" in message, message
    assert "name the tensor-parallel dimension 'tp'" in res["tp_unnamed", "ghost_fsdp"]["refused"]
    # (not "tp_fsdp_root_1x2": the forward before make_private leaves the root unit unsharded,
    # its parameters plain tensors, which FSDP2's layout check refuses with or without TP)
    accepted = ("tp", "tp_fsdp_1x2", "tp_fsdp_2x1")
    for res in run_ranks(wl.refused_parallelism, 2, accepted, ("ghost_fsdp", "ghost"), timeout=300):
        for layout in accepted:
            assert res[layout, "ghost_fsdp"]["refused"] is None, res[layout, "ghost_fsdp"]
            if layout == "tp":  # Opacus's "ghost" hooks: named the mode to use
                assert "'ghost_fsdp'" in res[layout, "ghost"]["refused"], res[layout, "ghost"]


def test_ghost_mode_on_an_fsdp_model_is_refused_naming_ghost_fsdp():
    """Opacus's ``"ghost"`` hooks on FSDP2 or FSDP1 parameters would crash in the first forward
    (``'Parameter' object has no attribute '_forward_counter'``): refused at ``make_private``."""
    layouts, modes = ("fsdp2_root", "fsdp1_root"), ("ghost",)
    res = _refused(
        run_ranks(wl.refused_parallelism, 2, layouts, modes, timeout=300), layouts, modes
    )
    for layout, title in zip(layouts, ("FSDP2", "FSDP1")):
        message = res[layout, "ghost"]["refused"]
        assert f"grad_sample_mode='ghost' cannot run on a {title} model" in message, message
        assert "use grad_sample_mode='ghost_fsdp'" in message, message
