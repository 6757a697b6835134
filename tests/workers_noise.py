"""Rank functions for the FSDP2 noise: one independent draw per coordinate, replicas equal."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.sharding import ShardingConfig, shard_model
from tests.private import make_private
from tests.workers_core import B_LOCAL, _data, _full_params

warnings.filterwarnings("ignore")


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 256), nn.ReLU())
        self.head = nn.Linear(256, 64)

    def forward(self, x):
        return self.head(self.block(x))


def _wide_data(world: int, steps: int):
    """A seeded ``Wide`` model and ``steps`` global batches of data (labels below 64)."""
    torch.manual_seed(0)
    base = Wide()
    x, y = _data(world, steps)
    return base, x, y % 64


def _sharded(base, backend="fsdp2", strategy="full"):
    """A sharded copy of ``base`` (one unit per large layer, CPU)."""
    cfg = ShardingConfig(
        strategy=strategy, wrap_policy="size_based", min_num_params=1000, backend=backend
    )
    return shard_model(copy.deepcopy(base), cfg, device=torch.device("cpu"))


def _private(base, x, y, world, *, backend="fsdp2", strategy="full", noise=1.0, lr=1.0, seed=None):
    """``(model, gsm, opt, crit)``: a private ``ghost_fsdp`` (C 1, SGD) sharded copy of ``base``."""
    model = _sharded(base, backend, strategy)
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    gsm, opt, crit, _ = make_private(
        PrivacyEngine(),
        model,
        (x, y),
        B_LOCAL * world,
        1.0,
        "ghost_fsdp",
        noise=noise,
        lr=lr,
        noise_generator=gen,
    )
    return model, gsm, opt, crit


def _step(base, x, y, rank, world, strategy, noise, backend="fsdp2"):
    """One private SGD step (lr 1, C 1) of a sharded copy of ``base``; returns the model."""
    model, gsm, opt, crit = _private(
        base, x, y, world, backend=backend, strategy=strategy, noise=noise
    )
    lo, hi = rank * B_LOCAL, (rank + 1) * B_LOCAL
    crit(gsm(x[lo:hi]), y[lo:hi]).backward()
    opt.step()
    return model, type(opt).__name__


def _local(model) -> dict[str, torch.Tensor]:
    """This rank's own shard of every parameter (FSDP2 local tensors, FSDP1 local views)."""
    return {
        n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _full(model, backend) -> dict[str, torch.Tensor]:
    if backend == "fsdp1":
        from tests.workers_fsdp1 import _full as fsdp1_full

        return fsdp1_full(model)
    return _full_params(model)


def noise_draws(rank: int, world: int, strategy: str, backend: str = "fsdp2") -> dict:
    """The noise of one step, in units of its standard deviation (sigma C / (W b))."""
    # every rank seeded identically: the dangerous case
    base, x, y = _wide_data(world, 1)
    b = B_LOCAL * world
    noisy, name = _step(base, x, y, rank, world, strategy, 1.0, backend)
    noisy_full, noisy_local = _full(noisy, backend), _local(noisy)
    clean, _ = _step(base, x, y, rank, world, strategy, 0.0, backend)
    clean_full, clean_local = _full(clean, backend), _local(clean)
    per_param = {n: (clean_full[n] - noisy_full[n]) * b for n in sorted(clean_full)}
    noise = torch.cat([t.flatten() for t in per_param.values()])
    local = torch.cat([(clean_local[n] - noisy_local[n]).flatten() * b for n in clean_local])
    return {"noise": noise, "per_param": per_param, "local": local, "optimizer": name}


def sum_reduction(rank: int, world: int, backend: str) -> dict:
    """loss_reduction="sum" under FSDP (which averages gradients) equals the loop."""
    from opacus_fsdp_sync.testing import clip_each_sample_step, per_sample_clipped_grads
    from tests.models import toy_sample_loss

    base, x, y = _wide_data(world, 1)
    b = B_LOCAL * world

    def loss_fn(m, a, t):
        return toy_sample_loss(m, a, t)

    _, norms = per_sample_clipped_grads(copy.deepcopy(base), loss_fn, x, y, 1.0)
    C = norms.median().item()
    ref = copy.deepcopy(base)
    clip_each_sample_step(ref, loss_fn, x, y, C, 0.05, loss_reduction="sum")
    model = _sharded(base, backend)
    gsm, opt, crit, _ = make_private(
        PrivacyEngine(),
        model,
        (x, y),
        b,
        C,
        "ghost_fsdp",
        lr=0.05,
        criterion=nn.CrossEntropyLoss(reduction="sum"),
        loss_reduction="sum",
    )
    lo, hi = rank * B_LOCAL, (rank + 1) * B_LOCAL
    crit(gsm(x[lo:hi]), y[lo:hi]).backward()
    opt.step()
    got = _full(model, backend)
    want = {n: p.detach() for n, p in ref.named_parameters()}
    return {
        "vs_loop": max((got[k] - want[k]).abs().max().item() for k in want),
        "update": max(
            (want[k] - p.detach()).abs().max().item() for k, p in base.named_parameters()
        ),
    }


def fsdp1_local_noise(rank: int, world: int) -> torch.Tensor:
    """This rank's own FSDP1 shard of one step's noise, every rank seeded identically."""
    base, x, y = _wide_data(world, 1)
    noisy = _local(_step(base, x, y, rank, world, "full", 1.0, "fsdp1")[0])
    clean = _local(_step(base, x, y, rank, world, "full", 0.0, "fsdp1")[0])
    return torch.cat([(clean[n] - noisy[n]).flatten() for n in clean])


def prefetch_vs_draw_at_step(rank: int, world: int, backend: str = "fsdp2") -> dict:
    """The noise drawn during the backward (default) against the noise drawn at step time.

    Two runs per case with the same noise seed: plain steps (the same draw, so bit for bit), and
    a virtual step (two micro-batches, so the drawn standard deviation is rescaled at the step).
    ``drawn_ahead`` counts the steps whose noise was drawn during the backward.
    """
    base, x, y = _wide_data(world, 3)
    b = B_LOCAL * world
    out = {}
    for case, micro in (("plain", 1), ("virtual", 2)):
        params = {}
        drawn_ahead = 0
        for prefetch in (True, False):
            model, gsm, opt, crit = _private(base, x, y, world, backend=backend, seed=7)
            if not prefetch:
                opt.prefetch_noise = lambda: None
            for s in range(2):
                xs, ys = x[s * b : (s + 1) * b], y[s * b : (s + 1) * b]
                lo = rank * B_LOCAL
                mb = B_LOCAL // micro
                for m in range(micro):
                    sl = slice(lo + m * mb, lo + (m + 1) * mb)
                    crit(gsm(xs[sl]), ys[sl]).backward()
                    if m < micro - 1:
                        opt.signal_skip_step(do_skip=True)
                    elif prefetch and getattr(opt, "_prefetched", None) is not None:
                        drawn_ahead += 1
                    opt.step()
                    opt.zero_grad()
            params[prefetch] = _full(model, backend)
        start = _full(_sharded(base, backend), backend)
        out[case] = {
            "diff": max((params[True][n] - params[False][n]).abs().max().item() for n in start),
            "moved": max((params[True][n] - start[n]).abs().max().item() for n in start),
            "drawn_ahead": drawn_ahead,
        }
    return out


def large_batch_scale(rank: int, world: int, batch: int) -> dict:
    """With a tiny noise multiplier, the step's gradient must be the summed gradient / B."""
    torch.manual_seed(0)
    model = _sharded(Wide())
    x, y = torch.zeros(batch * world, 16), torch.zeros(batch * world, dtype=torch.long)
    gsm, opt, crit, _ = make_private(
        PrivacyEngine(), model, (x, y), batch * world, 1.0, "ghost_fsdp", noise=1e-20, lr=0.0
    )
    for p in opt.params:
        p.grad = torch.ones_like(p)
    opt.step()
    local = torch.cat([p.grad.to_local().flatten() for p in opt.params])
    expected = 1.0 / opt.expected_batch_size
    return {"rel_err": ((local - expected).abs().max() / expected).item()}


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.a = nn.Linear(32, 8)
        self.b = nn.Linear(32, 8)
        self.use_b = True

    def forward(self, x):
        h = self.body(x)
        return self.a(h) + self.b(h) if self.use_b else self.a(h)


def unused_parameter_gets_noise(rank: int, world: int) -> dict:
    """A layer used in step 1 and not in step 2: no error, and step 2 still adds its noise."""
    torch.manual_seed(0)
    base = TwoHeads()
    x, y = _data(world, 2)
    b = B_LOCAL * world
    out = {}
    for noise in (0.0, 1.0):
        model, gsm, opt, crit = _private(base, x, y, world, noise=noise)
        lo = rank * B_LOCAL
        for s in range(2):
            model.use_b = s == 0
            xs, ys = x[s * b : (s + 1) * b], y[s * b : (s + 1) * b]
            if s == 1:
                before = {n: t.clone() for n, t in _full_params(model).items()}
            crit(gsm(xs[lo : lo + B_LOCAL]), ys[lo : lo + B_LOCAL]).backward()
            opt.step()
            opt.zero_grad()
        after = _full_params(model)
        out[noise] = {n: (after[n] - before[n]).abs().max().item() for n in after if ".b." in n}
    return out


def _local_grads(opt) -> list:
    """Each parameter's local gradient (None where this rank holds none)."""
    out = []
    for p in opt.params:
        g = p.grad
        out.append(None if g is None else (g.to_local() if hasattr(g, "to_local") else g).clone())
    return out


def noised_gradient_is_scaled_sum_plus_noise(rank: int, world: int, backend: str) -> dict:
    """Step gradient = factor * summed + noise, over two steps, with both ``zero_grad`` modes.

    Run A trains on the data; run B has the same noise seed and a zero loss, so its step
    gradient is the noise alone. ``grad_A - grad_B`` must then be ``summed_A / B`` (the local
    shard before the step), step after step: a gradient that aliased a buffer another step
    reuses, or noise added to the wrong shard, would break it.
    """
    base, x, y = _wide_data(world, 2)
    b = B_LOCAL * world
    out = {}
    for set_to_none in (False, True):
        grads: dict[bool, list] = {}
        summed: list = []
        for zero_loss in (False, True):
            model, gsm, opt, crit = _private(base, x, y, world, backend=backend, lr=0.1, seed=11)
            lo = rank * B_LOCAL
            grads[zero_loss] = []
            for s in range(2):
                xs, ys = x[s * b : (s + 1) * b], y[s * b : (s + 1) * b]
                loss = crit(gsm(xs[lo : lo + B_LOCAL]), ys[lo : lo + B_LOCAL])
                (loss * 0.0 if zero_loss else loss).backward()
                if not zero_loss:
                    summed.append(_local_grads(opt))
                opt.step()
                grads[zero_loss].append(_local_grads(opt))
                opt.zero_grad(set_to_none=set_to_none)
        factor = 1.0 / opt.expected_batch_size
        err = size = noise = 0.0
        for s in range(2):
            for ga, gb, g in zip(grads[False][s], grads[True][s], summed[s]):
                if g is None or g.numel() == 0:
                    continue
                expected = g * factor
                err = max(err, (ga - gb - expected).abs().max().item())
                size = max(size, expected.abs().max().item())
                noise = max(noise, gb.abs().max().item())
        # the zero-loss run's step gradients are its noise: a new draw at every step
        fresh = all(
            not torch.equal(a, b)
            for a, b in zip(grads[True][0], grads[True][1])
            if a is not None and a.numel() > 0
        )
        out[set_to_none] = {"err": err, "grad": size, "noise": noise, "fresh": fresh}
    return out


def reduce_scatter_output_is_released(rank: int, world: int) -> dict:
    """After ``step()`` no gradient keeps FSDP2's reduce-scatter output alive.

    FSDP2's sharded gradients are views of the reduce-scatter output; the step's gradient lives
    in the noise buffer, so the output must be freed by the step (one gradient-sized buffer
    through the wrapped optimizer's step, not two).
    """
    import gc
    import weakref

    base, x, y = _wide_data(world, 2)
    b = B_LOCAL * world
    model, gsm, opt, crit = _private(base, x, y, world, lr=0.1)
    lo = rank * B_LOCAL
    out = {"bases": 0, "alive_after_step": 0}
    for s in range(2):
        xs, ys = x[s * b : (s + 1) * b], y[s * b : (s + 1) * b]
        crit(gsm(xs[lo : lo + B_LOCAL]), ys[lo : lo + B_LOCAL]).backward()
        refs = []
        for p in opt.params:
            base = p.grad.to_local()._base
            if base is not None:
                refs.append(weakref.ref(base))
        del base
        opt.step()
        gc.collect()
        out["bases"] += len(refs)
        out["alive_after_step"] += sum(r() is not None for r in refs)
        opt.zero_grad(set_to_none=False)
    return out


def stale_layout_recovers(rank: int, world: int) -> list[list[str]]:
    """Dtypes drawn per step when the parameters change dtype in place after the first step.

    The prefetched draw of the step after the change has the old layout and is redrawn; from
    then on one draw per step again (the cached layout was refreshed).
    """
    from opacus_fsdp_sync.optimizers import noise_prefetch
    from opacus_fsdp_sync.optimizers.fsdp2 import ShardedNoiseFSDPOptimizer

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    opt = ShardedNoiseFSDPOptimizer(
        torch.optim.SGD(layer.parameters(), lr=0.1),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=4,
    )
    orig, drawn = noise_prefetch.draw_flat_noise, []  # the draw's one home

    def logging_draw(layout, std, generator):
        drawn.append(str(layout[0][1]))
        return orig(layout, std, generator)

    noise_prefetch.draw_flat_noise = logging_draw
    per_step = []
    try:
        for step in range(4):
            if step == 1:
                layer.double()
            start = len(drawn)
            opt.prefetch_noise()  # what the engine does at the start of each backward
            for p in layer.parameters():
                p.grad = torch.ones_like(p)
            opt.step()
            opt.zero_grad()
            per_step.append(drawn[start:])
    finally:
        noise_prefetch.draw_flat_noise = orig
    return per_step


def threads_after_run(rank: int, world: int, backend: str = "fsdp2") -> dict:
    """Names of the threads alive besides this process's own, at three points: after the last
    step of a run; after a backward whose noise draw started but no step took it (a run that
    stops on an error); and after the optimizer and model are dropped."""
    import gc
    import threading
    import time

    before = {t.ident for t in threading.enumerate()}

    def ours() -> list[str]:
        return sorted(t.name for t in threading.enumerate() if t.ident not in before)

    def settled(deadline: float = 10.0) -> list[str]:
        end = time.monotonic() + deadline
        while ours() and time.monotonic() < end:
            time.sleep(0.05)
        return ours()

    base, x, y = _wide_data(world, 3)
    model, gsm, opt, crit = _private(base, x, y, world, backend=backend, seed=7)
    lo = rank * B_LOCAL
    for s in range(2):
        off = s * B_LOCAL * world
        crit(gsm(x[off + lo : off + lo + B_LOCAL]), y[off + lo : off + lo + B_LOCAL]).backward()
        opt.step()
        opt.zero_grad()
    after_steps = ours()  # immediately: the step joined its draw
    crit(gsm(x[lo : lo + B_LOCAL]), y[lo : lo + B_LOCAL]).backward()  # draws ahead, no step
    pending = getattr(opt, "_prefetched", None) is not None
    after_pending = settled()
    del model, gsm, opt, crit
    gc.collect()
    return {
        "after_steps": after_steps,
        "pending": pending,
        "after_pending": after_pending,
        "after_drop": settled(),
    }


def with_noise_kernel(rank: int, world: int, name: str, *args) -> dict:
    """``name(rank, world, *args)`` (this module's, or ``"module:function"``), counting the noise
    kernel's launches at steps.

    Run with ``OPACUS_FSDP_SYNC_NOISE_KERNEL=1`` under ``TRITON_INTERPRET=1``: returns the
    worker's result, the launches at steps that returned (one per noise stream and noised step;
    :func:`~opacus_fsdp_sync.optimizers.noise_kernel.agree`'s probes are not counted) and
    whether a probe failed (which would have turned the kernel off). Torch's draw raises
    meanwhile: a step that took it on the kernel's path fails the worker.
    """
    from opacus_fsdp_sync.optimizers import noise_kernel, noise_prefetch

    launches = [0]
    original = noise_kernel.noised_agreed
    torch_draw = noise_prefetch.draw_flat_noise

    def refused(*a, **kw):
        raise AssertionError("torch's draw was called on the kernel's path")

    def counted(*a, **kw):
        out = original(*a, **kw)
        launches[0] += 1  # after it returned
        return out

    if ":" in name:  # another module's worker, "module:function"
        import importlib

        module, _, function = name.partition(":")
        worker = getattr(importlib.import_module(module), function)
    else:
        worker = globals()[name]
    noise_kernel.noised_agreed = counted
    noise_prefetch.draw_flat_noise = refused
    try:
        result = worker(rank, world, *args)
    finally:
        noise_kernel.noised_agreed = original
        noise_prefetch.draw_flat_noise = torch_draw
    return {"result": result, "launches": launches[0], "failed": bool(noise_kernel._FAILED)}


def noise_path_agreement(rank: int, world: int, wanted: list[str]) -> list[str]:
    """The optimizer's noise path with ``OPACUS_FSDP_SYNC_NOISE_KERNEL=wanted[rank]`` on each
    rank (under the interpreter), for FSDP2 and FSDP1: the ranks must agree."""
    import os
    import types

    from opacus_fsdp_sync.optimizers import noise_kernel
    from opacus_fsdp_sync.sharding.dp_state import noise_layout

    os.environ[noise_kernel.ENV] = wanted[rank]
    base, x, y = _wide_data(world, 1)
    paths = []
    for backend in ("fsdp2", "fsdp1"):
        _, gsm, opt, _ = _private(base, x, y, world, backend=backend)
        engine = types.SimpleNamespace(distributed_api=backend)
        # what a checkpoint keeps
        assert noise_layout(engine, opt)["noise_path"] == opt.noise_path()
        paths.append(opt.noise_path())
    return paths
