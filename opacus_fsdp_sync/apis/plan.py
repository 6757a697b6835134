"""What one ``make_private`` call runs: its optimizer and layout, one backward or two.

The call's plan (:func:`plan_call`) is decided from the model before Opacus wraps it: the API's
record, its optimizer factory and the :class:`~..distributed.layout.Layout` value. Whether the
step runs one backward, and with which per-sample gradient policy, is decided once, when the
criterion is prepared, from the options, the API's record (its hand-off and whether it can
replay a layer generically) and the hooked layers; each reason for two passes is logged.
"""

from __future__ import annotations

import dataclasses
import logging

import opacus
import torch

from ..distributed.detect import _unwrap
from ..distributed.layout import Layout, check_layout, check_parallelism, detect_layout
from ..distributed.tensor_parallel import check_secure_mode
from ..errors import UnsupportedConfigurationError
from ..layers.ownership import ownership_refusals
from ..layers.registry import refusals
from ..options import GhostOptions
from .api import GHOST_MODES, OPACUS_MODES, OptimizerFactory
from .registry import Detected, detect_api

logger = logging.getLogger("opacus_fsdp_sync")

#: What Opacus's ``make_private`` counts as distributed (by the passed object's type).
_OPACUS_DISTRIBUTED = (
    opacus.distributed.DifferentiallyPrivateDistributedDataParallel,
    torch.nn.parallel.DistributedDataParallel,
    torch.distributed.fsdp.FSDPModule,
)


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """What one ``make_private`` call decided from the model before Opacus wrapped it."""

    optimizer: OptimizerFactory | None = None
    """This package's optimizer for the call (from the API's record), or None for Opacus's."""
    ghost: bool = False
    """The call is in a ghost mode (the calls this engine changes)."""
    missed_distributed: bool = False
    """The layout is distributed but Opacus, judging by the wrapper's type, counts it as one
    process (FSDP1; FSDP2 without a root unit or below a plain wrapper): the data loader and the
    expected batch per rank must be the distributed ones."""
    layout: Layout = Layout()
    """The model's layout: its data-parallel degree and rank set the sampler's shares, the
    expected batch per rank and the gradient divisor; its tp group the hooks' sums."""


def plan_call(kwargs: dict, opts: GhostOptions, *, secure_mode: bool) -> CallPlan:
    """Decides, from the model before Opacus wraps it, which optimizer and layout the call has.

    Args:
        kwargs: The arguments of ``make_private``.
        opts: The call's options.
        secure_mode: The engine's.

    Raises:
        UnsupportedConfigurationError: for an unknown ``grad_sample_mode`` (naming the
            allowed ones), a ghost mode the model's API cannot run (naming the one to use),
            and what the API's record or the layout refuses.
    """
    mode = kwargs.get("grad_sample_mode", "hooks")
    if mode not in (*GHOST_MODES, *OPACUS_MODES):
        raise UnsupportedConfigurationError(
            f"grad_sample_mode={mode!r}: choose one of {', '.join(map(repr, GHOST_MODES))} "
            f"(ghost clipping; 'ghost_fsdp' for FSDP and tensor-parallel models, 'ghost_tp' "
            f"as upstream's name for the latter) or Opacus's "
            f"{', '.join(map(repr, OPACUS_MODES))}"
        )
    if mode not in GHOST_MODES or "module" not in kwargs:
        if "module" in kwargs:  # Opacus's own modes miscalibrate these layouts too
            check_parallelism(_unwrap(kwargs["module"]))
        return CallPlan()
    module = kwargs["module"]
    found = detect_api(module)
    check_layout(_unwrap(module), found)
    refused = refusals(_unwrap(module))
    if refused:
        raise UnsupportedConfigurationError(
            "layers whose gradient cannot be clipped per sample: " + "; ".join(refused)
        )
    unhooked = ownership_refusals(_unwrap(module))
    if unhooked:
        raise UnsupportedConfigurationError(
            "trainable parameters that no hooked layer call covers (their per-sample norms "
            "would be missing): " + "; ".join(unhooked)
        )
    layout = detect_layout(_unwrap(module))
    factory = found.record.plan_optimizer(  # raises for what the API cannot run
        found.modules,
        options=opts,
        secure_mode=secure_mode,
        grad_sample_mode=mode,
        layout=layout,
    )
    accepted = found.record.capabilities.ghost_modes
    if mode not in accepted:
        raise UnsupportedConfigurationError(
            f"grad_sample_mode={mode!r} cannot run on a {found.record.title} model: use "
            f"grad_sample_mode={accepted[0]!r} (this API takes "
            f"{', '.join(map(repr, accepted))})"
        )
    check_secure_mode(layout.tensor_parallel, secure_mode)
    missed = found.record.capabilities.distributed and not isinstance(module, _OPACUS_DISTRIBUTED)
    return CallPlan(optimizer=factory, ghost=True, missed_distributed=missed, layout=layout)


def per_sample_policy(opts: GhostOptions, device: torch.device):
    """The per-sample gradient policy of the one-backward step, or None; logs it."""
    from ..layers.linear_policy import PerSampleGradPolicy
    from ..options import default_budget

    if opts.per_sample_grads is False:
        logger.info("[Ghost] per-sample gradients: off (ghost norms for every layer)")
        return None
    budget = opts.per_sample_grads_budget_bytes
    budget = default_budget(device) // 2 if budget is None else budget
    logger.info(
        "[Ghost] per-sample gradients of sequence Linear layers (%s), up to %.1f MiB per step",
        "where cheaper than ghost norms" if opts.per_sample_grads == "auto" else "all",
        budget / 2**20,
    )
    return PerSampleGradPolicy(
        budget,
        only_when_cheaper=opts.per_sample_grads == "auto",
        gram_block=opts.gram_block,
    )


def plan_handoff(module, found: Detected, opts: GhostOptions):
    """The one-backward hand-off for this model, or None (two passes); logs which and why.

    Every API's record has one; a hooked layer without a direct gradient formula where the
    record cannot replay it generically (sharded parameters), and DDP settings the
    hand-off does not emulate, take the two-pass step.
    """
    from ..hooks.ghost import step_hooks
    from ..one_backward.step import OneBackwardUnavailable, unsupported_layers

    if not (opts.one_backward and opts.restricted_first_pass):
        why = "one_backward=False" if opts.restricted_first_pass else "no restricted pass"
        logger.info("[Ghost] step: two backward passes (%s)", why)
        return None
    if not module.batch_first:
        logger.info("[Ghost] step: two backward passes (batch_first=False)")
        return None
    record = found.record
    try:
        handoff = record.make_handoff(found.modules)
    except OneBackwardUnavailable as err:
        logger.info("[Ghost] step: two backward passes (%s)", err)
        return None
    type_of = step_hooks(module).layer_type
    missing = unsupported_layers(
        list(module.iterate_submodules(module._module)),
        type_of,
        generic_replay=record.capabilities.generic_replay,
    )
    if missing:
        logger.info(
            "[Ghost] step: two backward passes (no direct gradient formula for %s under %s)",
            ", ".join(missing),
            record.name,
        )
        return None
    logger.info("[Ghost] step: one backward (clipped weight gradients from the first pass)")
    return handoff
