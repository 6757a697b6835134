"""Rank functions for the layout calibration tests: every layout calibrated or refused.

Each layout shards (or replicates) one MLP 32-256-256-4 a different way. A calibrated layout must
give the clip-each-sample loop's update with noise 0 and, with noise 1, an update whose difference
from the noise-0 update has standard deviation ``sigma C / B`` (B the global batch) per
coordinate. A refused layout must raise at ``make_private`` and leave the model without hooks.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.testing import per_sample_clipped_grads
from tests.private import make_private

warnings.filterwarnings("ignore")
B_LOCAL, C, SIGMA, SEED = 4, 1.0, 1.0, 7


class MLP(nn.Module):
    """32-256-256-4 with ReLUs: 74,756 parameters."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(32, 256), nn.Linear(256, 256), nn.Linear(256, 4)

    def forward(self, x):
        return self.l3(F.relu(self.l2(F.relu(self.l1(x)))))


class Outer(nn.Module):
    """A user's wrapper around the (possibly sharded) MLP, optionally with a layer of its own."""

    def __init__(self, inner: nn.Module, extra: bool = False):
        super().__init__()
        self.inner = inner
        self.extra = nn.Linear(4, 4) if extra else None

    def forward(self, x):
        out = self.inner(x)
        return out if self.extra is None else self.extra(out)


def _sample_loss(model, x, y):
    return F.cross_entropy(model(x), y)


def _fsdp2(layout: str, world: int) -> nn.Module:
    """The FSDP2 layouts: with and without a root unit, one unit inside a wrapper, unmanaged."""
    mesh = init_device_mesh("cpu", (world,))
    model = _base()
    if layout == "fsdp2_replicate":  # torch's FSDP-based composable replicate: an FSDP2 unit
        from torch.distributed._composable.replicate_with_fsdp import replicate

        return replicate(model, mesh=mesh)
    if layout == "fsdp2_inner":
        for layer in (model.l1, model.l2, model.l3):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return Outer(model)
    sharded = (
        (model.l1, model.l2)
        if layout.startswith("fsdp2_unmanaged")
        else (model.l1, model.l2, model.l3)
    )
    for layer in sharded:
        fully_shard(layer, mesh=mesh)
    if layout == "fsdp2_root":
        fully_shard(model, mesh=mesh)
    if layout == "fsdp2_unmanaged_frozen":
        model.l3.requires_grad_(False)
    return model


def _fsdp1(layout: str, world: int) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    def wrap(m):
        return FSDP(
            m,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )

    if layout == "fsdp1_root":
        return wrap(_base())
    if layout == "fsdp1_inner":
        return Outer(wrap(_base()))
    if layout == "fsdp1_unmanaged":
        return Outer(wrap(_base()), extra=True)
    raise ValueError(layout)


def _ddp(layout: str, world: int) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    if layout == "ddp_root":
        return DDP(_base())
    if layout == "ddp_nested":
        return Outer(DDP(_base()))
    raise ValueError(layout)


def _base() -> MLP:
    torch.manual_seed(0)
    return MLP()


def _data(world: int):
    g = torch.Generator().manual_seed(1)
    b = B_LOCAL * world
    return 3 * torch.randn(b, 32, generator=g), torch.randint(0, 4, (b,), generator=g)


BUILD = {"fsdp2": _fsdp2, "fsdp1": _fsdp1, "ddp": _ddp}
#: Every layout the tests cover, and whether it is calibrated (True) or refused (False).
LAYOUTS = {
    "fsdp2": {
        "fsdp2_root": True,
        "fsdp2_rootless": True,
        "fsdp2_inner": True,
        "fsdp2_unmanaged_frozen": True,
        "fsdp2_unmanaged": False,
        "fsdp2_replicate": True,
    },
    "fsdp1": {"fsdp1_root": True, "fsdp1_inner": True, "fsdp1_unmanaged": False},
    "ddp": {"ddp_root": True, "ddp_nested": False},
}


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter in full, by its name in the plain MLP."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    fsdp1 = [m for m in model.modules() if isinstance(m, FSDP)]
    if fsdp1:
        with FSDP.summon_full_params(fsdp1[0]):
            return _named(model)
    return _named(model)


def _named(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        t = p.full_tensor() if isinstance(p, DTensor) else p
        for junk in ("_fsdp_wrapped_module.", "module.", "inner."):
            n = n.replace(junk, "")
        out[n] = t.detach().clone()
    return out


def _local(model: nn.Module) -> torch.Tensor:
    """This rank's own copy of every trainable parameter (the local shard under FSDP)."""
    parts = []
    for p in model.parameters():
        if p.requires_grad:
            parts.append((p.to_local() if isinstance(p, DTensor) else p).detach().flatten())
    return torch.cat(parts).clone()


def _hooked(model: nn.Module) -> int:
    """Forward hooks on the model's modules (FSDP2 has its own; Opacus adds one per layer)."""
    return sum(len(m._forward_hooks) for m in model.modules())


#: Layouts whose ranks hold whole replicas: every rank draws the same noise for the same
#: coordinates (no independent shards to compare).
REPLICATED = ("fsdp2_replicate",)

#: The layouts run again under ``secure_mode`` (Opacus's optimizers, its secure noise).
SECURE = ("fsdp2_root", "fsdp2_rootless", "fsdp1_root", "ddp_root")


def _stand_in_csprng() -> None:
    """``secure_mode`` needs torchcsprng, which has no build for this torch: a stand-in whose
    generator is seeded from the OS CSPRNG (Opacus's secure code paths run unchanged)."""
    import os
    import sys
    import types

    mod = types.ModuleType("torchcsprng")
    mod.create_random_device_generator = lambda path: torch.Generator().manual_seed(
        int.from_bytes(os.urandom(8), "little") >> 1
    )
    sys.modules["torchcsprng"] = mod


def _one_step(api, layout, rank, world, x, y, noise, secure=False):
    model = BUILD[api](layout, world)
    mode = "ghost" if api == "ddp" else "ghost_fsdp"
    gsm, opt, crit, _ = make_private(
        PrivacyEngine(secure_mode=secure),
        model,
        (x, y),
        B_LOCAL * world,
        C,
        mode,
        noise=noise,
        lr=1.0,
        # identical on every rank (the dangerous case); secure_mode draws from its own
        noise_generator=None if secure else torch.Generator().manual_seed(SEED),
        shuffle=secure,
    )
    lo, hi = rank * B_LOCAL, (rank + 1) * B_LOCAL
    crit(gsm(x[lo:hi]), y[lo:hi]).backward()
    opt.step()
    return model


def layouts(rank: int, world: int, api: str, secure: bool = False) -> dict:
    """For each layout of ``api``: the refusal message, or the update and noise it produced.

    With ``secure``: the calibrated layouts of :data:`SECURE` only, under ``secure_mode``.
    """
    if secure:
        _stand_in_csprng()
    x, y = _data(world)
    before = _named(_base())
    out = {"norms": per_sample_clipped_grads(_base(), _sample_loss, x, y, C)[1]}
    for layout, calibrated in LAYOUTS[api].items():
        if secure and layout not in SECURE:
            continue
        if not calibrated:
            model = BUILD[api](layout, world)
            hooks = _hooked(model)
            try:
                make_private(
                    PrivacyEngine(),
                    model,
                    (x, y),
                    B_LOCAL * world,
                    C,
                    "ghost" if api == "ddp" else "ghost_fsdp",
                    noise=SIGMA,
                )
            except Exception as err:  # noqa: BLE001 - the message is what the test checks
                added = _hooked(model) - hooks
                out[layout] = {"refused": f"{type(err).__name__}: {err}", "hooks": added}
            else:
                out[layout] = {"refused": None}
            continue
        plain = _base()
        if layout.endswith("_frozen"):
            plain.l3.requires_grad_(False)
        ref, _ = per_sample_clipped_grads(plain, _sample_loss, x, y, C)
        clean = _one_step(api, layout, rank, world, x, y, 0.0, secure)
        noisy = _one_step(api, layout, rank, world, x, y, SIGMA, secure)
        clean_full, noisy_full = _full(clean), _full(noisy)
        update = {n: before[n] - clean_full[n] for n in clean_full}
        assert update.keys() == ref.keys(), (sorted(update), sorted(ref))
        vs_loop = max((update[n] - ref[n]).abs().max().item() for n in update)
        noise = torch.cat([(clean_full[n] - noisy_full[n]).flatten() for n in sorted(clean_full)])
        out[layout] = {
            "refused": None,
            "vs_loop": vs_loop,
            "update": max(g.abs().max().item() for g in ref.values()),
            "noise": noise,
            "local_noise": _local(clean) - _local(noisy),
            "fsdp2_units": sum(isinstance(m, FSDPModule) for m in clean.modules()),
        }
    return out


def unmanaged_parameters(rank: int, world: int) -> dict:
    """Our FSDP2 engine refuses before Opacus wraps anything, with either optimizer path."""
    x, y = _data(world)
    out = {}
    for name, kw in {"ours": {}, "upstream": {"sync_optimization": False}}.items():
        model = _fsdp2("fsdp2_unmanaged", world)
        hooks = _hooked(model)
        try:
            make_private(PrivacyEngine(), model, (x, y), B_LOCAL * world, C, "ghost_fsdp", **kw)
        except Exception as err:  # noqa: BLE001
            out[name] = (f"{type(err).__name__}: {err}", _hooked(model) - hooks)
        else:
            out[name] = (None, _hooked(model) - hooks)
    return out


def secure_replicas(rank: int, world: int) -> dict:
    """``secure_mode`` on FSDP2 layouts whose ranks hold the same coordinates: refused before
    anything is wrapped (each rank's secure noise would differ on the replicas)."""
    _stand_in_csprng()
    x, y = _data(world)
    out = {}
    for layout in ("fsdp2_replicate", "hsdp"):
        if layout == "hsdp":
            mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
            model = fully_shard(_base(), mesh=mesh)
        else:
            model = _fsdp2(layout, world)
        hooks = _hooked(model)
        try:
            make_private(
                PrivacyEngine(secure_mode=True),
                model,
                (x, y),
                B_LOCAL * world,
                C,
                "ghost_fsdp",
                shuffle=True,  # secure_mode's loader (as _one_step)
            )
        except Exception as err:  # noqa: BLE001 - the message is what the test checks
            out[layout] = (f"{type(err).__name__}: {err}", _hooked(model) - hooks)
        else:
            out[layout] = (None, _hooked(model) - hooks)
    return out


def keep_unsharded_plan(rank: int, world: int) -> dict:
    """``keep_unsharded="auto"`` with and without one backward: the decision, and the step."""
    x, y = _data(world)
    before = _named(_base())
    ref, _ = per_sample_clipped_grads(_base(), _sample_loss, x, y, C)
    out = {}
    for name, kw in {"one_backward": {}, "two_passes": {"one_backward": False}}.items():
        model = _fsdp2("fsdp2_root", world)
        engine = PrivacyEngine(keep_unsharded="auto", **kw)
        gsm, opt, crit, _ = make_private(
            engine, model, (x, y), B_LOCAL * world, C, "ghost_fsdp", lr=1.0
        )
        lo, hi = rank * B_LOCAL, (rank + 1) * B_LOCAL
        crit(gsm(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
        after = _full(model)
        out[name] = {
            "keep": engine.keep_unsharded,
            "one": engine.one_backward,
            "vs_loop": max((before[n] - after[n] - ref[n]).abs().max().item() for n in ref),
        }
    return out


def _tensor_parallel(model: nn.Module, mesh) -> nn.Module:
    """l1 column-wise, l2 row-wise (torch's tensor parallelism); l3 stays a plain Linear."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    return parallelize_module(model, mesh, {"l1": ColwiseParallel(), "l2": RowwiseParallel()})


def _unsupported(layout: str, world: int) -> nn.Module:
    """Layouts whose noise the engine cannot calibrate: DDP-based replicate, tensor parallelism;
    and the FSDP layouts (``fsdp2_root``, ``fsdp1_root``), refused with ``grad_sample_mode``
    ``"ghost"``."""
    if layout.startswith(("fsdp2_", "fsdp1_")):
        return (_fsdp2 if layout.startswith("fsdp2") else _fsdp1)(layout, world)
    model = _base()
    if layout.startswith("replicate_ddp"):
        from torch.distributed._composable.replicate import replicate

        replicate(model.l2 if layout == "replicate_ddp_inner" else model)
        return model
    if layout == "tp":
        return _tensor_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    if layout == "tp_unnamed":
        return _tensor_parallel(model, init_device_mesh("cpu", (world,)))
    # "tp_fsdp_DxT", "tp_fsdp_root_DxT", "tp_replicate_DxT": TP over "tp", then FSDP2 (per layer
    # and root, or root only) or FSDP's replicate over "dp"
    kind, shape = layout.rsplit("_", 1)
    mesh = init_device_mesh("cpu", tuple(map(int, shape.split("x"))), mesh_dim_names=("dp", "tp"))
    _tensor_parallel(model, mesh["tp"])
    if kind == "tp_replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        return replicate(model, mesh=mesh["dp"])
    if kind == "tp_fsdp":
        for layer in (model.l1, model.l2, model.l3):
            fully_shard(layer, mesh=mesh["dp"])
    # "tp_fsdp_root": the root unit only; after a forward it holds TP's 1-D DTensors unsharded
    return fully_shard(model, mesh=mesh["dp"])


def refused_parallelism(rank: int, world: int, layouts: tuple[str, ...], modes: tuple) -> dict:
    """For each layout and mode: the refusal message (None: accepted), the forward hooks
    ``make_private`` left behind, and whether the model's forward still gives what it gave."""
    x, y = _data(world)
    out = {}
    for layout in layouts:
        for mode in modes:
            model = _unsupported(layout, world)
            hooks = _hooked(model)
            with torch.no_grad():
                before = model(x)
            try:
                make_private(PrivacyEngine(), model, (x, y), B_LOCAL * world, C, mode)
            except Exception as err:  # noqa: BLE001 - the message is what the test checks
                message = f"{type(err).__name__}: {err}"
            else:
                message = None
            added = _hooked(model) - hooks
            with torch.no_grad():
                same = torch.equal(model(x), before)
            out[layout, mode] = {"refused": message, "hooks": added, "same_forward": same}
    return out
