"""FSDP1 (``FullyShardedDataParallel``, ``use_orig_params=True``): controller, hand-off, record.

FSDP1 frees the unsharded parameters a retained graph points into at the end of a backward that
computes weight gradients, so ghost clipping under FSDP1 needs the activations-only first pass:
it produces no parameter gradient (FSDP1 reduce-scatters nothing and does not reshard), its
final callback is held back, and every state is set back to IDLE afterwards, so that the second
backward runs as a normal FSDP1 backward, or the one-backward hand-off continues it. One root
instance, ``FULL_SHARD``, ``SHARD_GRAD_OP`` or ``NO_SHARD``; the private attributes are in
:mod:`._fsdp1_internals`.
"""

from __future__ import annotations

import logging
import sys

from torch import nn

from ..distributed import _fsdp1_internals as internals
from ..distributed import version_gate
from ..distributed._fsdp2_internals import FSDPInternalsError
from ..distributed.layout import listing, world_size
from ..errors import UnsupportedConfigurationError, attach_cleanup_error
from .api import FSDP1, ApiRecord, Capabilities, WholeStepHandoff, shared_noise_optimizer

logger = logging.getLogger("opacus_fsdp_sync")


class FSDP1Controller:
    """FSDP1: the activations-only first pass, with FSDP1's end-of-iteration held back.

    The first pass must produce no parameter gradient (so FSDP1 reduce-scatters nothing and
    does not reshard); its final callback is kept from being queued, and every state is set back
    to IDLE afterwards, so that the second backward runs as a normal FSDP1 backward, or the
    one-backward hand-off (``_fsdp1_internals.reduce_clipped_gradients``) continues it.
    """

    api = FSDP1
    requires_restricted = True
    enabled_message = (
        "[Ghost] FSDP1 optimization enabled: first backward w.r.t. activations only, "
        "no reduce-scatter and no re-all-gather"
    )

    def __init__(self, root: nn.Module):
        self.root = root
        self._previous: bool | None = None

    def begin_first_pass(self) -> None:
        """Keeps FSDP1's final callback from ending the iteration after the first pass.

        Raises:
            UnsupportedConfigurationError: inside the user's ``no_sync()``: the DP step clears
                gradients between micro-batches (as upstream does), so an unsynced micro-batch
                would silently never reach the update.
        """
        if not internals.syncs_gradients(self.root):
            raise UnsupportedConfigurationError(
                "FSDP1 no_sync() gradient accumulation is not supported with ghost clipping: the "
                "private step clears gradients between backward passes, so the unsynced "
                "micro-batch would be dropped silently. Raise the DataLoader's batch_size (the "
                "expected batch) and split each draw with BatchMemoryManager instead."
            )
        self._previous = internals.hold_final_callback(self.root)

    def end_first_pass(self) -> None:
        """Re-arms FSDP1's pre-backward hooks for the second pass."""
        if self._previous is not None:
            internals.reopen_backward(self.root, self._previous)
            self._previous = None

    def abort(self) -> None:
        """Puts every state back to IDLE (a one-backward hand-off may have raised midway).

        As :meth:`FSDP2Controller.abort`, a failure here never replaces the error being handled.

        Raises:
            FSDPInternalsError: only when that failed and no exception is being handled.
        """
        pending = sys.exc_info()[1]
        try:
            internals.end_backward_after_failure(self.root)
        except Exception as err:
            broken = version_gate.versioned_cleanup_error(
                err, "recovering FSDP1 after a failed step", cls=FSDPInternalsError
            )
            if pending is None:
                if broken is err:
                    raise
                raise broken from err
            attach_cleanup_error(pending, broken)


class FSDP1Handoff(WholeStepHandoff):
    """Each handle's unsharded flat gradient, then FSDP1's own post-backward and final callback.

    Keyed by (module, attribute): FSDP1's own metadata maps a tied weight's uses to one slot of
    its flat parameter, where they add up.
    """

    phase = "reduce_scatter"

    def __init__(self, root: nn.Module):
        self.root = root

    def hand(self, grads: dict) -> None:
        """Reduce-scatters the clipped gradients through FSDP1's own post-backward."""
        internals.reduce_clipped_gradients(self.root, grads)


def _controller(modules: list[nn.Module], *, enabled: bool, restricted: bool = False, **_):
    """Raises for what FSDP1 cannot run, even with the optimisation off (see the module)."""
    if not (enabled and restricted):
        raise UnsupportedConfigurationError(
            "Ghost clipping under FSDP1 (FullyShardedDataParallel) needs the activations-only "
            "first pass: FSDP1 frees the unsharded parameters the retained graph points into "
            "at the end of a first backward that computes weight gradients, so the second "
            "backward fails (upstream Opacus rejects FSDP1 for this reason). Keep "
            "sync_optimization=True and restricted_first_pass=True, or use FSDP2."
        )
    if len(modules) > 1:
        raise UnsupportedConfigurationError(
            f"Ghost clipping under FSDP1 needs one root FullyShardedDataParallel; this model "
            f"has {len(modules)} outermost instances, each ending the backward on its "
            "own. Wrap the whole model once more (FullyShardedDataParallel(model, ...)), as "
            "opacus_fsdp_sync.sharding.shard_model does."
        )
    if not internals.uses_orig_params(modules[0]):
        raise UnsupportedConfigurationError(
            "Ghost clipping under FSDP1 needs use_orig_params=True: with flat parameters the "
            "layers Opacus hooks own no parameter, so their per-sample norms would be "
            "missing. Wrap with FullyShardedDataParallel(..., use_orig_params=True) (what "
            "opacus_fsdp_sync.sharding.shard_model does)."
        )
    bad = internals.sharding_strategies(modules[0]) - {
        "FULL_SHARD",
        "SHARD_GRAD_OP",
        "NO_SHARD",
    }
    if bad:
        raise UnsupportedConfigurationError(
            f"Ghost clipping under FSDP1 supports FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, not "
            f"{sorted(bad)} (its noise would have to be shared within replica groups only); "
            "use FSDP2 with strategy 'hybrid_full'."
        )
    return FSDP1Controller(modules[0])


def _handoff(modules: list[nn.Module]) -> FSDP1Handoff:
    return FSDP1Handoff(modules[0])


def _sharded(inner, *, generator, secure_mode: bool, **kwargs):
    from ..optimizers import FSDP1DPOptimizer

    logger.info("[Ghost] FSDP1: sharded DP optimizer, independent noise per shard")
    return FSDP1DPOptimizer(inner, generator=generator, secure_mode=secure_mode, **kwargs)


def check_comm_hook(root: nn.Module) -> None:
    """Refuses an FSDP1 communication hook that may not average the clipped gradients.

    The DP optimizers add noise of std ``sigma * C / B`` to gradients they take as averaged
    over the ranks; a hook that sums, rounds to 16 bits or divides by another factor changes
    the effective noise multiplier silently (see
    :func:`~..distributed._fsdp1_internals.comm_hook_refusals`). Read at ``make_private`` only.

    Raises:
        UnsupportedConfigurationError: naming each hook and its state.
    """
    refused = internals.comm_hook_refusals(root)
    if refused:
        raise UnsupportedConfigurationError(
            f"FSDP1 communication hook(s) {listing(refused)} may not average the clipped "
            "gradients over the ranks: the DP noise (std sigma * C / B) is calibrated for the "
            "average, so a hook that sums, compresses or divides by another factor changes the "
            "effective noise multiplier silently. Register no hook (FSDP1's own reduction "
            "averages), or torch's default_hooks.allreduce_hook / reduce_scatter_hook with "
            "DefaultState(<the FSDP process group>); do not register one after make_private."
        )


def _plan_optimizer(modules, *, options, secure_mode: bool, grad_sample_mode: str, layout):
    """Sharded noise per held shard, or one shared draw for ``NO_SHARD`` replicas.

    Raises:
        UnsupportedConfigurationError: for what FSDP1 cannot run (see :func:`_controller`),
            a communication hook that may not average (:func:`check_comm_hook`), mixed
            strategies, or ``NO_SHARD`` with ``secure_mode``.
    """
    _controller(
        modules, enabled=options.sync_optimization, restricted=options.restricted_first_pass
    )
    check_comm_hook(modules[0])
    strategies = internals.sharding_strategies(modules[0])
    if len(strategies) > 1:
        raise UnsupportedConfigurationError(
            f"FSDP1 units mix sharding strategies {sorted(strategies)}; use one strategy."
        )
    if "NO_SHARD" in strategies:
        if secure_mode:
            raise UnsupportedConfigurationError(
                "FSDP1 NO_SHARD replicas must add one shared noise draw, which secure_mode "
                "cannot provide here; use FULL_SHARD or SHARD_GRAD_OP, or FSDP2."
            )
        return shared_noise_optimizer
    return _sharded


def _check_layout(model: nn.Module, modules: list[nn.Module]) -> None:
    """Refuses trainable parameters outside every FSDP1 instance (no rank would reduce them)."""
    if world_size() <= 1:
        return
    managed = {id(p) for unit in modules for p in unit.parameters()}
    plain = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in managed]
    if plain:
        raise UnsupportedConfigurationError(
            f"{len(plain)} trainable parameter(s) lie outside every FullyShardedDataParallel "
            f"instance: {listing(plain)}. Wrap the whole model "
            "(FullyShardedDataParallel(model, ...), as opacus_fsdp_sync.sharding.shard_model "
            "does) or freeze them."
        )


RECORD = ApiRecord(
    name=FSDP1,
    title="FSDP1",
    # Opacus's "ghost" hooks expect the module's own parameters; FSDP1 flattens them.
    capabilities=Capabilities(distributed=True, sharded=True, ghost_modes=("ghost_fsdp",)),
    make_controller=_controller,
    make_handoff=_handoff,
    plan_optimizer=_plan_optimizer,
    check_layout=_check_layout,
)
