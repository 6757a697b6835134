"""Whether a model's step runs one backward, and with which per-sample gradient policy.

Decided once, when the criterion is prepared, from the options, the API's record (its hand-off
and whether it can replay a layer generically) and the hooked layers; each reason for two
passes is logged.
"""

from __future__ import annotations

import logging

import torch

from ..apis.registry import Detected
from ..options import GhostOptions

logger = logging.getLogger("opacus_fsdp_sync")


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
