"""DDP (``DistributedDataParallel`` at the model's top): its controller, hand-off and record.

DDP arms its reducer in forward, so ``no_sync()`` around a backward does nothing: what skips
the first pass's all-reduce is the activations-only first pass, which produces no parameter
gradient. The clipped gradients are then averaged once, by the one-backward hand-off below (one
bucketed all-reduce with DDP's arithmetic: each gradient divided by the world size while copied
into a flat bucket, the buckets summed over ranks and copied back; all launched before any is
waited on; DDP's reducer sees nothing in the whole step, see :mod:`._ddp_internals`), or by
DDP's own all-reduce in the clipped second pass. The DP optimizer then adds one noise draw
shared by every rank and does not all-reduce again
(:class:`~opacus_fsdp_sync.optimizers.SharedNoiseDPOptimizer`).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import _ddp_internals as internals
from ..errors import UnsupportedConfigurationError
from .api import (
    DDP,
    ApiRecord,
    Capabilities,
    WholeStepHandoff,
    no_layout_check,
    shared_noise_optimizer,
)
from .single import NullController

logger = logging.getLogger("opacus_fsdp_sync")


class DDPController:
    """DDP: DDP arms its reducer in forward, so ``no_sync()`` around a backward does nothing.

    What skips the first pass's all-reduce is the activations-only first pass: it produces no
    parameter gradient, so none of DDP's hooks fires. The clipped gradients are then averaged
    once: by default by the one-backward hand-off
    (:class:`DDPHandoff`, one bucketed all-reduce, DDP's
    reducer sees nothing in the whole step), otherwise by DDP's own bucketed all-reduce in the
    clipped second pass. The engine swaps in
    :class:`~opacus_fsdp_sync.optimizers.SharedNoiseDPOptimizer`, which does not all-reduce
    again. A step that could not restrict its first pass must therefore fail.
    """

    api = DDP
    requires_restricted = True
    enabled_message = (
        "[Ghost] DDP optimization enabled: first backward w.r.t. activations only, "
        "one bucketed all-reduce per step"
    )

    def __init__(self, module: nn.Module):
        self.module = module

    def begin_first_pass(self) -> None:
        """Checks DDP will all-reduce in this step (the swapped optimizer will not).

        Raises:
            UnsupportedConfigurationError: inside the user's ``ddp.no_sync()``.
        """
        if not self.module.require_backward_grad_sync:
            raise UnsupportedConfigurationError(
                "DDP no_sync() gradient accumulation is not supported by the sync-skipping step "
                "(its optimizer relies on DDP's all-reduce in every step): raise the DataLoader's "
                "batch_size (the expected batch) and split each draw with BatchMemoryManager, "
                "or pass restricted_first_pass=False to PrivacyEngine."
            )

    def end_first_pass(self) -> None:
        """Nothing to restore."""

    def abort(self) -> None:
        """Nothing to reset for DDP: its reducer re-arms at the next forward."""


def _add_grad(p: nn.Parameter, g: torch.Tensor) -> None:
    g = g.to(p.dtype)
    if p.grad is None:
        p.grad = g
    else:  # in place: keeps DDP's gradient_as_bucket_view aliasing
        p.grad.add_(g)


def buckets(tensors: list[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """Indices of ``tensors`` grouped into buckets of one device and dtype, as DDP fills them.

    Tensors are taken in reverse order (DDP's approximation of the order gradients become
    ready); a bucket is closed once it holds at least ``cap_bytes``.
    """
    open_: dict[tuple, list[int]] = {}
    sizes: dict[tuple, int] = {}
    out: list[list[int]] = []
    for i in reversed(range(len(tensors))):
        t = tensors[i]
        key = (t.device, t.dtype)
        open_.setdefault(key, []).append(i)
        sizes[key] = sizes.get(key, 0) + t.numel() * t.element_size()
        if sizes[key] >= cap_bytes:
            out.append(open_.pop(key))
            sizes.pop(key)
    out.extend(open_.values())
    return out


def all_reduce_mean(tensors: list[torch.Tensor], group, cap_bytes: int) -> int:
    """Averages ``tensors`` in place over ``group``, in flat buckets of about ``cap_bytes``.

    Each tensor is divided by the group size before the sum, as DDP's reducer does.

    Returns:
        The number of all-reduces issued.
    """
    world = dist.get_world_size(group)
    pending = []
    for idx in buckets(tensors, cap_bytes):
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        flat.mul_(1.0 / world)
        pending.append((idx, flat, dist.all_reduce(flat, group=group, async_op=True)))
    for idx, flat, work in pending:
        work.wait()
        offset = 0
        for i in idx:
            n = tensors[i].numel()
            tensors[i].copy_(flat[offset : offset + n].view_as(tensors[i]))
            offset += n
    return len(pending)


class DDPHandoff(WholeStepHandoff):
    """Delivers one step's clipped gradients to a DDP model's ``p.grad``, averaged over ranks.

    Args:
        ddp: The ``DistributedDataParallel`` module (its reducer is left alone).

    Raises:
        DDPInternalsError: if DDP's attributes are not as on the verified torch releases.
    """

    phase = "all_reduce"
    """The name of the hand-off phase in timings and collective counts."""

    def __init__(self, ddp: nn.Module):
        self.ddp = ddp
        self.params = internals.reduced_parameters(ddp)
        self.group = internals.process_group(ddp)
        self.cap_bytes = internals.bucket_bytes_cap(ddp)

    def hand(self, grads: dict) -> None:
        """Adds the clipped gradients to ``p.grad`` and averages every reduced gradient.

        A parameter DDP reduces that got no gradient on this rank contributes zeros (and
        receives the average), as with DDP's ``find_unused_parameters=True``; a parameter DDP
        ignores keeps its local gradient.
        """
        from ..one_backward.step import by_parameter

        for p, g in by_parameter(grads).values():
            _add_grad(p, g)
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        all_reduce_mean([p.grad for p in self.params], self.group, self.cap_bytes)

    __call__ = hand


def _controller(modules, *, enabled: bool, restricted: bool = False, **_):
    if not enabled:
        return NullController()
    if not restricted:
        logger.info("[Ghost] DDP without the activations-only first pass: upstream passes")
        return NullController()
    if internals.static_graph(modules[0]):
        # the first iteration's delayed all-reduce fires at the end of the activations-only
        # pass and marks every parameter unused for good: ranks then step apart, silently
        raise UnsupportedConfigurationError(
            "DDP static_graph=True cannot run the activations-only first pass (DDP's "
            "first-iteration delayed all-reduce would mark every parameter unused and stop "
            "averaging gradients). Build DDP without static_graph, or pass "
            "restricted_first_pass=False to PrivacyEngine (upstream's two passes)."
        )
    return DDPController(modules[0])


def _handoff(modules: list[nn.Module]) -> DDPHandoff:
    from ..one_backward.step import OneBackwardUnavailable

    blocker = internals.one_backward_blocker(modules[0])
    if blocker is not None:
        raise OneBackwardUnavailable(f"{blocker} is not supported by the DDP hand-off")
    return DDPHandoff(modules[0])


def check_comm_hook(ddp: nn.Module) -> None:
    """Refuses a DDP communication hook that may not average the clipped gradients over ranks.

    The DP optimizers add noise of std ``sigma * C / B`` to gradients they take as averaged over
    ranks; a summing hook (2 ranks: twice the update, half the effective noise multiplier),
    PowerSGD or a 16-bit compress hook breaks that silently. No hook, torch's
    ``default_hooks.allreduce_hook`` and DDP's own mixed-precision hook pass (see
    :func:`~..distributed._ddp_internals.comm_hook_refusal`). Read at ``make_private`` only:
    registering a hook afterwards is not supported.

    Raises:
        UnsupportedConfigurationError: naming the hook, why, and what to do.
        DDPInternalsError: if this torch does not have the attributes read.
    """
    refused = internals.comm_hook_refusal(ddp)
    if refused is not None:
        name, why = refused
        raise UnsupportedConfigurationError(
            f"DDP communication hook {name} is not supported: {why}. The DP noise (std "
            "sigma * C / B) is calibrated for gradients averaged over ranks by DDP. Register "
            "no hook (DDP's default averaging) or torch's "
            "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook, and "
            "register none after make_private either (not supported)."
        )


def check_process_group(ddp: nn.Module) -> None:
    """Refuses DDP on a process group of fewer ranks than the world.

    The DP optimizers scale the noise for gradients averaged over every rank (and share one
    draw over all of them); DDP on a subgroup averages over that subgroup only, so each
    update carries less noise than the accountant's.

    Raises:
        UnsupportedConfigurationError: naming the group's size and the world's.
    """
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(ddp.process_group)
    if len(ranks) != dist.get_world_size():
        raise UnsupportedConfigurationError(
            f"DDP on a process group of {len(ranks)} of the {dist.get_world_size()} ranks: the "
            "DP noise is scaled for gradients averaged over every rank, and this group averages "
            "over fewer, so each update would carry less noise than the accountant counts. "
            "Build DistributedDataParallel over all ranks (process_group=None)."
        )


def _plan_optimizer(modules, *, options, secure_mode: bool, grad_sample_mode: str, layout):
    """The shared-noise optimizer behind the activations-only pass (gradients arrive averaged).

    Every call first refuses a communication hook that may not average (:func:`check_comm_hook`)
    and a process group that leaves ranks out (:func:`check_process_group`).
    """
    check_comm_hook(modules[0])
    check_process_group(modules[0])
    if options.sync_optimization and not secure_mode and options.restricted_first_pass:
        _controller(modules, enabled=True, restricted=True)  # raises early (static_graph)
        return shared_noise_optimizer
    return None


RECORD = ApiRecord(
    name=DDP,
    title="DDP",
    capabilities=Capabilities(
        distributed=True, generic_replay=True, ghost_modes=("ghost", "ghost_fsdp")
    ),
    make_controller=_controller,
    make_handoff=_handoff,
    plan_optimizer=_plan_optimizer,
    check_layout=no_layout_check,
)
