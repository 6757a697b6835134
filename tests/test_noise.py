"""FSDP2 noise: one independent N(0, (sigma C / (W b))^2) draw per coordinate; replicas equal."""

import os
import threading

import pytest
import torch

from opacus_fsdp_sync.testing import run_ranks
from tests import workers_noise

pytestmark = [pytest.mark.distributed]


@pytest.mark.parametrize("backend", ["fsdp2", "fsdp1"])
def test_full_shard_noise_is_independent_per_coordinate_with_the_right_scale(backend):
    r0, r1 = run_ranks(workers_noise.noise_draws, 2, "full", backend, timeout=300)
    assert (
        r0["optimizer"]
        == {"fsdp2": "ShardedNoiseFSDPOptimizer", "fsdp1": "FSDP1DPOptimizer"}[backend]
    )
    z = r0["noise"]
    assert torch.equal(z, r1["noise"])  # the full parameters agree on both ranks
    n = z.numel()
    assert n > 20000
    assert abs(z.std().item() - 1.0) < 0.03, z.std()
    assert abs(z.mean().item()) < 0.03
    # The two ranks' own shards must not repeat each other's draws (identically seeded ranks).
    k = min(r0["local"].numel(), r1["local"].numel())
    assert k > 1000
    a, b = r0["local"][:k], r1["local"][:k]
    assert not torch.equal(a, b)
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.1
    # Each parameter is split by rows between the two ranks: the halves must not repeat each
    # other's draws (they would if both ranks drew from one identically seeded stream).
    for name, t in r0["per_param"].items():
        rows = t.shape[0] // 2
        a, b = t[:rows].flatten(), t[rows : 2 * rows].flatten()
        assert not torch.equal(a, b), name
        if a.numel() >= 1000:
            corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
            assert abs(corr) < 0.1, (name, corr)


def test_replicas_of_a_shard_add_the_same_noise():
    r0, r1 = run_ranks(workers_noise.noise_draws, 2, "no_shard", timeout=300)
    assert torch.equal(r0["noise"], r1["noise"])
    assert abs(r0["noise"].std().item() - 1.0) < 0.03


@pytest.mark.parametrize("backend", ["fsdp2", "fsdp1"])
def test_sum_reduction_equals_the_loop(backend):
    for res in run_ranks(workers_noise.sum_reduction, 2, backend, timeout=300):
        assert res["update"] > 1e-3
        assert res["vs_loop"] <= 1e-6


def test_fsdp1_shards_draw_independent_noise():
    a, b = run_ranks(workers_noise.fsdp1_local_noise, 2, timeout=300)
    m = min(a.numel(), b.numel())
    assert m > 1000
    assert not torch.allclose(a[:m], b[:m])
    assert abs(torch.corrcoef(torch.stack([a[:m], b[:m]]))[0, 1].item()) < 0.1


@pytest.mark.parametrize("backend", ["fsdp2", "fsdp1"])
def test_noise_drawn_during_the_backward_equals_the_draw_at_step_time(backend):
    for res in run_ranks(workers_noise.prefetch_vs_draw_at_step, 2, backend, timeout=300):
        assert res["plain"]["moved"] > 1e-2 and res["virtual"]["moved"] > 1e-2
        # FSDP1 learns the held shards' sizes in its first step and draws ahead from the second
        assert res["plain"]["drawn_ahead"] == {"fsdp2": 2, "fsdp1": 1}[backend], res
        assert res["plain"]["diff"] == 0.0  # same generator, same draws, same order
        assert res["virtual"]["diff"] <= 1e-6 * res["virtual"]["moved"]  # rescaled at the step


@pytest.mark.parametrize("batch", [60000, 1000])
def test_large_batch_gradient_scale_is_exact(batch):
    """A lerp with weight 1 - 1/B in fp32 mis-scaled the gradient by about B * 2^-25."""
    for res in run_ranks(workers_noise.large_batch_scale, 1, batch, timeout=300):
        assert res["rel_err"] <= 1e-6, res


def test_a_parameter_unused_in_a_step_still_gets_noise():
    for res in run_ranks(workers_noise.unused_parameter_gets_noise, 2, timeout=300):
        assert all(v == 0.0 for v in res[0.0].values()), res  # no noise, unused: unchanged
        assert all(v > 1e-3 for v in res[1.0].values()), res  # noise on: moved by the noise


@pytest.mark.parametrize("backend", ["fsdp2", "fsdp1"])
def test_noised_gradient_is_the_scaled_sum_plus_the_noise(backend):
    """One pass writes noise + grad / B into the noise buffer; the gradient then aliases it."""
    worker = workers_noise.noised_gradient_is_scaled_sum_plus_noise
    for res in run_ranks(worker, 2, backend, timeout=300):
        for case in res.values():
            assert case["grad"] > 1e-3 and case["noise"] > 1e-3, res
            # one rounding of noise + grad / B (the noise is the larger term)
            assert case["err"] <= 4 * 2**-24 * (case["noise"] + case["grad"]), res


def test_step_releases_the_reduce_scatter_output():
    for res in run_ranks(workers_noise.reduce_scatter_output_is_released, 2, timeout=300):
        assert res["bases"] > 0, res  # FSDP2's gradients were views of its output
        assert res["alive_after_step"] == 0, res


def test_prefetch_layout_refreshes_after_a_dtype_change():
    """A stale cached layout costs one redraw, not a redraw on every later step."""
    (per_step,) = run_ranks(workers_noise.stale_layout_recovers, 1, timeout=120)
    assert per_step[0] == ["torch.float32"], per_step
    assert per_step[1] == ["torch.float32", "torch.float64"], per_step  # stale prefetch redrawn
    assert per_step[2:] == [["torch.float64"], ["torch.float64"]], per_step


def test_prefetched_views_are_recorded_once_per_flat_buffer():
    """The CUDA prefetch records its stream once per drawn buffer, not once per view."""
    from opacus_fsdp_sync.optimizers.noise_prefetch import draw_flat_noise, one_per_storage

    shapes = [torch.Size([3, 4]), torch.Size([5]), torch.Size([2, 2]), torch.Size([7])]
    dtypes = [torch.float32, torch.float32, torch.float64, torch.float32]
    layout = tuple((s, d, torch.device("cpu")) for s, d in zip(shapes, dtypes))
    views = draw_flat_noise(layout, 1.0, torch.Generator().manual_seed(0))
    firsts = one_per_storage(views)
    assert [t.dtype for t in firsts] == [torch.float32, torch.float64]  # one buffer per dtype
    assert firsts[0] is views[0] and firsts[1] is views[2]
    separate = [torch.zeros(2), torch.zeros(2)]
    assert len(one_per_storage(separate)) == 2


@pytest.mark.parametrize("backend", ["fsdp2", "fsdp1"])
def test_no_thread_of_ours_outlives_the_run(backend):
    """The noise drawn during the backward runs in a short-lived thread: none is alive after the
    last step, after a backward whose draw no step took (it ends with its draw), and after the
    optimizer is dropped; so nothing of ours holds the process at exit."""
    for res in run_ranks(workers_noise.threads_after_run, 2, backend, timeout=300):
        assert res["pending"], res  # the path under test: a draw was running in a thread
        assert res["after_steps"] == [] and res["after_pending"] == [], res
        assert res["after_drop"] == [], res


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_prefetch_thread_draws_at_idle_priority_and_leaves_the_caller_alone():
    """The CPU draw runs at idle priority (it fills collective waits and never preempts a rank's
    main thread), draws what a draw at step time draws, and the caller keeps its own policy."""
    from opacus_fsdp_sync.optimizers.noise_prefetch import (
        DrawAhead,
        draw_flat_noise,
        lower_to_idle_priority,
    )

    probe = {}
    thread = threading.Thread(target=lambda: probe.update(ok=lower_to_idle_priority()))
    thread.start()
    thread.join()
    if not probe["ok"]:
        pytest.skip("this kernel refuses SCHED_IDLE")
    layout = ((torch.Size([4, 5]), torch.float32, torch.device("cpu")),)
    seen = {}

    def draw():
        seen["policy"] = os.sched_getscheduler(0)
        return draw_flat_noise(layout, 2.0, torch.Generator().manual_seed(3))

    before = os.sched_getscheduler(0)
    (drawn,) = DrawAhead(draw, torch.device("cpu")).result()
    assert seen["policy"] == os.SCHED_IDLE
    assert os.sched_getscheduler(0) == before
    (direct,) = draw_flat_noise(layout, 2.0, torch.Generator().manual_seed(3))
    assert torch.equal(drawn, direct)


def test_cuda_draws_reuse_one_side_stream_per_device(monkeypatch):
    """Every CUDA draw goes to the same side stream of its device: the caching allocator keeps a
    freed block for its stream, so a new stream per step (torch.cuda.Stream() hands out the next
    of a pool) left each step's noise buffer unreusable (an H100 trace: 32 cudaFree a step)."""
    from opacus_fsdp_sync.optimizers import noise_prefetch

    made = []

    class FakeStream:
        def __init__(self, device):
            made.append(device)

    monkeypatch.setattr(noise_prefetch, "_SIDE_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    first = noise_prefetch.side_stream(torch.device("cuda", 0))
    assert noise_prefetch.side_stream(torch.device("cuda", 0)) is first
    assert noise_prefetch.side_stream(torch.device("cuda")) is first  # the current device's
    other = noise_prefetch.side_stream(torch.device("cuda", 1))
    assert other is not first
    assert made == [torch.device("cuda", 0), torch.device("cuda", 1)]


def test_draw_ahead_on_cuda_takes_the_side_stream(monkeypatch):
    """DrawAhead draws on side_stream's stream (not a new one per draw), waits on the caller's
    stream and hands the result over through an event."""
    import contextlib

    from opacus_fsdp_sync.optimizers import noise_prefetch

    calls = []

    class FakeStream:
        def wait_stream(self, other):
            calls.append(("wait_stream", other))

        def record_event(self):
            calls.append("record_event")
            return object()

    side = FakeStream()
    monkeypatch.setattr(noise_prefetch, "side_stream", lambda device: side)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: pytest.fail("a new stream"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "main")
    monkeypatch.setattr(
        torch.cuda, "stream", lambda s: calls.append(("in", s)) or contextlib.nullcontext()
    )
    for _ in range(2):
        noise_prefetch.DrawAhead(lambda: [torch.zeros(2)], torch.device("cuda", 0))
    assert calls == [("wait_stream", "main"), ("in", side), "record_event"] * 2
