"""Per-API control of gradient synchronisation around the norm-only first backward.

Each controller has the same two methods. ``begin_first_pass`` turns gradient sync off and makes
sure the pass leaves no gradient behind; ``end_first_pass`` (always called, in ``finally``) drops
whatever the pass produced and restores the user's own settings and gradients exactly.
"""

from __future__ import annotations

import logging
import sys

from torch import nn

from . import _ddp_internals as ddp_internals
from . import _fsdp1_internals as fsdp1
from . import _fsdp2_internals as internals
from . import version_gate
from .detect import DDP, FSDP1, FSDP2, DistributedRoot

logger = logging.getLogger("opacus_fsdp_sync")


class UnsupportedConfigurationError(ValueError):
    """A model/API combination that the sync-skipping backward cannot handle."""


class NullController:
    """Single device, or the optimisation switched off: the first pass runs unchanged."""

    api: str | None = None
    enabled_message = ""

    def begin_first_pass(self) -> None:
        """Does nothing."""

    def end_first_pass(self) -> None:
        """Does nothing."""

    def abort(self) -> None:
        """Does nothing."""


class FSDP2Controller:
    """FSDP2 (``fully_shard``): no reduce-scatter in the first pass, nothing of it kept.

    ``begin_first_pass`` saves each parameter group's sync flags and sets them off (and, with
    ``keep_unsharded``, its reshard-after-backward flag, so that the second backward finds every
    unit unsharded and issues no all-gather), moves any
    unsharded gradient the user accumulated aside, and hooks every unsharded parameter so that
    each first-pass gradient is dropped as soon as autograd accumulates it (so the pass never
    holds a full unsharded gradient copy). ``end_first_pass`` removes the hooks, clears anything
    left, puts the user's gradients back and restores the saved flags.
    """

    api = FSDP2
    enabled_message = (
        "[Ghost] FSDP2 optimization enabled: disabling gradient sync for first backward"
    )

    def __init__(self, modules: list[nn.Module], *, keep_unsharded: bool = False):
        self.modules = modules
        self.keep_unsharded = keep_unsharded
        self._saved_reshard: list[tuple[object, bool]] = []
        self._saved_flags: list[tuple[object, tuple[bool, bool]]] = []
        self._stash: list[tuple[object, tuple]] = []
        self._hooks: list = []
        self._broken: version_gate.TorchInternalsError | None = None

    def begin_first_pass(self) -> None:
        """Turns gradient sync off and arms the early gradient drop.

        Raises:
            FSDPInternalsError: when an earlier failed step could not be cleaned up.
        """
        if self._broken is not None:
            raise internals.FSDPInternalsError(
                "opacus_fsdp_sync: an earlier step failed and FSDP2 could not be put back in "
                f"order afterwards ({self._broken}); this step would be wrong. Restart from a "
                "checkpoint.",
                feature=self._broken.feature,
            ) from self._broken
        groups = list(internals.iter_param_groups(self.modules))
        self._saved_flags = [(g, internals.get_sync_flags(g)) for g in groups]
        for g in groups:
            internals.set_sync_flags(g, (False, False))
        if self.keep_unsharded:  # the second backward then needs no all-gather
            self._saved_reshard = [(g, internals.get_reshard_after_backward(g)) for g in groups]
            for g in groups:
                internals.set_reshard_after_backward(g, False)
        for g in groups:
            for fp in internals.fsdp_params(g):
                taken = internals.take_unsharded_grads(fp)
                if taken != (None, None):
                    self._stash.append((fp, taken))
                param = internals.unsharded_param(fp)
                if param is not None and param.requires_grad:
                    self._hooks.append(param.register_post_accumulate_grad_hook(_drop_grad))

    def end_first_pass(self) -> None:
        """Drops first-pass gradients and restores the user's gradients and sync flags.

        If this fails while the step's own error is being handled, that error keeps
        propagating (see :meth:`abort`).

        Raises:
            FSDPInternalsError: when FSDP2's internals are not as on the tested torch releases
                and no exception is being handled.
        """
        pending = sys.exc_info()[1]
        try:
            try:
                for handle in self._hooks:
                    handle.remove()
                for g, _ in self._saved_flags:
                    for fp in internals.fsdp_params(g):
                        internals.take_unsharded_grads(fp)
                for fp, grads in self._stash:
                    internals.put_unsharded_grads(fp, grads)
            finally:
                for g, flags in self._saved_flags:
                    internals.set_sync_flags(g, flags)
                for g, flag in self._saved_reshard:
                    internals.set_reshard_after_backward(g, flag)
                self._hooks, self._stash, self._saved_flags, self._saved_reshard = [], [], [], []
        except Exception as err:
            self._cleanup_failed(err, pending, "ending the FSDP2 first pass")

    def abort(self) -> None:
        """Resets FSDP2 after a backward or hand-off raised midway; never masks that error.

        Drops every unreduced (unsharded) gradient, as the engine drops the sharded ones (a
        hand-off that failed after setting some would otherwise leave them to be added into the
        next step), and resets FSDP2's per-iteration state with the public
        ``FSDPModule.reset_iter_state()`` (see
        :func:`~opacus_fsdp_sync.distributed._fsdp2_internals.reset_after_failure`).

        When that recovery itself fails, FSDP2 is left in a state in which the next step would
        be wrong. If an exception is being handled (the step's own failure, the usual caller),
        that exception keeps propagating: the recovery error is logged and attached to it (as a
        note and as ``__opacus_abort_error__``), and this controller refuses every later step,
        naming the recovery error. Called outside exception handling, it raises.

        Raises:
            FSDPInternalsError: only when recovery failed and no exception is being handled.
        """
        pending = sys.exc_info()[1]  # the step's own failure, when called while handling it
        try:
            internals.reset_after_failure(self.modules)
        except Exception as err:
            self._cleanup_failed(err, pending, "recovering FSDP2 after a failed step")

    def _cleanup_failed(self, err: Exception, pending: BaseException | None, feature: str) -> None:
        """Reports a failed cleanup: raised if nothing else is, else attached to what is."""
        self._broken = _versioned(err, feature)
        if pending is None:
            if self._broken is err:
                raise
            raise self._broken from err
        _attach(pending, self._broken)
        logger.error("[Ghost] %s", self._broken, exc_info=(type(err), err, err.__traceback__))


def _versioned(err: Exception, feature: str) -> version_gate.TorchInternalsError:
    """The versioned error for a failed cleanup (``err`` itself when it is one)."""
    if isinstance(err, version_gate.TorchInternalsError):
        return err
    out = version_gate.internals_error(
        feature,
        f"a cleanup that works (it raised {type(err).__name__}: {err})",
        "The next step would be wrong: restart from a checkpoint.",
        cls=internals.FSDPInternalsError,
    )
    out.__cause__ = err
    return out


def _attach(pending: BaseException, error: Exception) -> None:
    """Records a cleanup failure on the exception that is propagating, without replacing it."""
    note = f"While recovering from this error, opacus_fsdp_sync also failed: {error}"
    if hasattr(pending, "add_note"):  # Python >= 3.11
        pending.add_note(note)
    try:
        pending.__opacus_abort_error__ = error
    except AttributeError:  # an exception type with __slots__
        pass


def _drop_grad(param: nn.Parameter) -> None:
    param.grad = None


class DDPController:
    """DDP: DDP arms its reducer in forward, so ``no_sync()`` around a backward does nothing.

    What skips the first pass's all-reduce is the activations-only first pass: it produces no
    parameter gradient, so none of DDP's hooks fires. The clipped gradients are then averaged
    once: by default by the one-backward hand-off
    (:class:`~opacus_fsdp_sync.one_backward.ddp.DDPHandoff`, one bucketed all-reduce, DDP's
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
        if not getattr(self.module, "require_backward_grad_sync", True):
            raise UnsupportedConfigurationError(
                "DDP no_sync() gradient accumulation is not supported by the sync-skipping step "
                "(its optimizer relies on DDP's all-reduce in every step): accumulate with "
                "Opacus's virtual steps (optimizer.signal_skip_step / BatchMemoryManager), or "
                "pass restricted_first_pass=False to PrivacyEngine."
            )

    def end_first_pass(self) -> None:
        """Nothing to restore."""

    def abort(self) -> None:
        """Nothing to reset for DDP: its reducer re-arms at the next forward."""


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
        if not fsdp1.syncs_gradients(self.root):
            raise UnsupportedConfigurationError(
                "FSDP1 no_sync() gradient accumulation is not supported with ghost clipping: the "
                "private step clears gradients between backward passes, so the unsynced "
                "micro-batch would be dropped silently. Accumulate with Opacus's virtual steps "
                "(optimizer.signal_skip_step / BatchMemoryManager) instead."
            )
        self._previous = fsdp1.hold_final_callback(self.root)

    def end_first_pass(self) -> None:
        """Re-arms FSDP1's pre-backward hooks for the second pass."""
        if self._previous is not None:
            fsdp1.reopen_backward(self.root, self._previous)
            self._previous = None

    def abort(self) -> None:
        """Puts every state back to IDLE (a one-backward hand-off may have raised midway).

        As :meth:`FSDP2Controller.abort`, a failure here never replaces the error being handled.

        Raises:
            FSDPInternalsError: only when that failed and no exception is being handled.
        """
        pending = sys.exc_info()[1]
        try:
            fsdp1.end_backward_after_failure(self.root)
        except Exception as err:
            broken = _versioned(err, "recovering FSDP1 after a failed step")
            if pending is None:
                if broken is err:
                    raise
                raise broken from err
            _attach(pending, broken)
            logger.error("[Ghost] %s", broken, exc_info=(type(err), err, err.__traceback__))


def make_controller(
    root: DistributedRoot, *, enabled: bool, keep_unsharded: bool = False, restricted: bool = False
):
    """Builds the controller for a detected API.

    Args:
        root: the result of :func:`~opacus_fsdp_sync.distributed.detect.get_fsdp_root_module`.
        enabled: False returns a :class:`NullController` (upstream behaviour).
        keep_unsharded: FSDP2 only: keep parameters unsharded between the two passes.
        restricted: Whether the first pass is activations-only (DDP needs it to save anything).

    Raises:
        UnsupportedConfigurationError: for FSDP1 (its retained-graph double backward fails in
            torch's FSDP1 itself) without the activations-only pass or with an unsupported
            layout, and for DDP ``static_graph=True`` with it.
    """
    if root.api == FSDP1:
        if not (enabled and restricted):
            raise UnsupportedConfigurationError(
                "Ghost clipping under FSDP1 (FullyShardedDataParallel) needs the activations-only "
                "first pass: FSDP1 frees the unsharded parameters the retained graph points into "
                "at the end of a first backward that computes weight gradients, so the second "
                "backward fails (upstream Opacus rejects FSDP1 for this reason). Keep "
                "sync_optimization=True and restricted_first_pass=True, or use FSDP2."
            )
        if len(root.modules) > 1:
            raise UnsupportedConfigurationError(
                f"Ghost clipping under FSDP1 needs one root FullyShardedDataParallel; this model "
                f"has {len(root.modules)} outermost instances, each ending the backward on its "
                "own. Wrap the whole model once more (FullyShardedDataParallel(model, ...)), as "
                "opacus_fsdp_sync.sharding.shard_model does."
            )
        if not fsdp1.uses_orig_params(root.modules[0]):
            raise UnsupportedConfigurationError(
                "Ghost clipping under FSDP1 needs use_orig_params=True: with flat parameters the "
                "layers Opacus hooks own no parameter, so their per-sample norms would be "
                "missing. Wrap with FullyShardedDataParallel(..., use_orig_params=True) (what "
                "opacus_fsdp_sync.sharding.shard_model does)."
            )
        bad = fsdp1.sharding_strategies(root.modules[0]) - {
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
        return FSDP1Controller(root.modules[0])
    if not enabled or root.api is None:
        return NullController()
    if root.api == FSDP2:
        missing = [m for m in root.modules if not hasattr(m, "set_requires_gradient_sync")]
        if missing:
            logger.warning("Warning: FSDP detected but sync control not available")
            return NullController()
        return FSDP2Controller(root.modules, keep_unsharded=keep_unsharded)
    if root.api == DDP:
        if not restricted:
            logger.info("[Ghost] DDP without the activations-only first pass: upstream passes")
            return NullController()
        if ddp_internals.static_graph(root.modules[0]):
            # the first iteration's delayed all-reduce fires at the end of the activations-only
            # pass and marks every parameter unused for good: ranks then step apart, silently
            raise UnsupportedConfigurationError(
                "DDP static_graph=True cannot run the activations-only first pass (DDP's "
                "first-iteration delayed all-reduce would mark every parameter unused and stop "
                "averaging gradients). Build DDP without static_graph, or pass "
                "restricted_first_pass=False to PrivacyEngine (upstream's two passes)."
            )
        return DDPController(root.modules[0])
    raise AssertionError(f"unknown API {root.api!r}")
