"""FSDP2 (``fully_shard``): controller, hand-off and record.

The controller turns gradient sync off for the norm-only first pass (no reduce-scatter) and,
with ``keep_unsharded``, keeps parameters unsharded for the second pass (no all-gather); it drops
the first pass's gradients as they appear. The hand-off (one backward) works one parameter group
at a time, in backward order: each group's clipped weight gradients are computed and handed to
FSDP2's own post-backward (reduce-scatter with its reduce dtype, averaging and padding, then
reshard) before the next group's are computed, as a normal backward interleaves them. Only one
group's unsharded gradients are alive at a time (plus, on CUDA, the one whose reduce-scatter is
in flight), and on CUDA the next group's weight-gradient matmuls overlap the reduce-scatter,
which FSDP2 runs on its own stream. The DP optimizer draws noise for the local shard only
(:class:`~opacus_fsdp_sync.optimizers.ShardedNoiseFSDPOptimizer`). The private attributes are in
:mod:`._fsdp2_internals` and, for the hand-off, :mod:`._fsdp2_handoff_internals`.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager

from torch import nn

from ..distributed import _fsdp2_handoff_internals as handoff_internals
from ..distributed import _fsdp2_internals as internals
from ..distributed import version_gate
from ..distributed.tensor_parallel import as_param_grad
from ..errors import UnsupportedConfigurationError, attach_cleanup_error
from . import fsdp2_checks as checks
from .api import FSDP2, ApiRecord, Capabilities
from .single import NullController

logger = logging.getLogger("opacus_fsdp_sync")


class FSDP2Controller:
    """FSDP2 (``fully_shard``): no reduce-scatter in the first pass, nothing of it kept.

    ``begin_first_pass`` refuses a unit whose sync the user turned off (FSDP2's own gradient
    accumulation: its clipped gradients would reach a later step unreduced), saves each
    parameter group's sync flags and sets them off (and, with
    ``keep_unsharded``, its reshard-after-backward flag, so that the second backward finds every
    unit unsharded and issues no all-gather), moves any
    unsharded gradient the user accumulated aside, and hooks every unsharded parameter so that
    each first-pass gradient is dropped as soon as autograd accumulates it (so the pass never
    holds a full unsharded gradient copy). ``end_first_pass`` removes the hooks, clears anything
    left, puts the user's gradients back and restores the saved flags.
    """

    api = FSDP2
    requires_restricted = False
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
            UnsupportedConfigurationError: when the user turned gradient sync off on a unit
                (FSDP2's own accumulation), before anything is changed.
        """
        if self._broken is not None:
            raise internals.FSDPInternalsError(
                "opacus_fsdp_sync: an earlier step failed and FSDP2 could not be put back in "
                f"order afterwards ({self._broken}); this step would be wrong. Restart from a "
                "checkpoint.",
                feature=self._broken.feature,
            ) from self._broken
        groups = list(internals.iter_param_groups(self.modules))
        saved = [(g, internals.get_sync_flags(g)) for g in groups]
        off = [
            setter
            for i, setter in enumerate(("set_requires_gradient_sync", "set_requires_all_reduce"))
            if not all(flags[i] for _, flags in saved)
        ]
        if off:
            raise UnsupportedConfigurationError(
                f"FSDP2 gradient accumulation ({' and '.join(f'{s}(False)' for s in off)}) is "
                "not supported with ghost clipping: the private step "
                "would release this backward's clipped gradients unreduced (the update carried "
                "only noise) and add them to a later step's, two draws under one noise draw. "
                "Turn sync back on before the backward (set_requires_gradient_sync(True), "
                "set_requires_all_reduce(True)); to split a large expected batch, raise the "
                "DataLoader's batch_size and use BatchMemoryManager."
            )
        self._saved_flags = saved
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
        note and in ``cleanup_errors``), and this controller refuses every later step,
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
        self._broken = version_gate.versioned_cleanup_error(
            err, feature, cls=internals.FSDPInternalsError
        )
        if pending is None:
            if self._broken is err:
                raise
            raise self._broken from err
        attach_cleanup_error(pending, self._broken)


def _drop_grad(param: nn.Parameter) -> None:
    param.grad = None


class FSDP2Handoff:
    """Delivers clipped gradients to FSDP2 group by group (see the module docstring).

    Args:
        modules: The outermost FSDP2 modules.
    """

    #: The engine's phase name for the hand-off.
    phase = "reduce_scatter"

    def __init__(self, modules: list[nn.Module]):
        self.modules = modules

    def deliver(
        self,
        kept: list,
        compute: Callable[[list], dict],
        reduce_phase: Callable[[], AbstractContextManager],
    ) -> None:
        """Computes and reduces every group's clipped gradients; FSDP2 is idle afterwards.

        Args:
            kept: The first pass's ``(module, inputs, grad_out)`` entries; emptied as they are
                used, so their memory goes with their group.
            compute: Maps a list of entries to their clipped gradients by (module, name).
            reduce_phase: A context manager factory timing each group's hand-off.

        Raises:
            FSDPInternalsError: for a trainable parameter FSDP2 does not manage, or missing
                internals.
        """
        from ..one_backward.step import by_parameter

        groups, index = handoff_internals.param_group_index(self.modules)
        entries = list(kept)
        kept.clear()
        # each entry goes with the first of its groups visited (the last in module order); an
        # entry without a trainable parameter goes with the first group visited
        first = len(groups) - 1
        todo_of: dict[int, list[int]] = {}
        for j in range(len(entries)):  # no loop variable keeps an entry's tensors alive
            owner = self._groups_of(entries[j][0], index)
            todo_of.setdefault(max(owner) if owner else first, []).append(j)
        pending: dict[int, tuple] = {}
        for gi in reversed(range(len(groups))):
            todo = todo_of.pop(gi, None)
            if todo:
                grads = by_parameter(compute([entries[j] for j in todo]))
                for j in todo:
                    entries[j] = None
                for pid, (param, grad) in grads.items():
                    if pid not in index:
                        raise handoff_internals.unmanaged_param_error(param)
                    if pid in pending:  # a shared weight: its uses add up
                        grad = pending[pid][1] + grad
                    pending[pid] = (param, grad)
                del grads
            with reduce_phase():
                for pid in [pid for pid in pending if index[pid][0] == gi]:
                    fp, grad = index[pid][1], pending.pop(pid)[1]
                    # a tp shard becomes a DTensor of the unsharded parameter's placements
                    grad = as_param_grad(internals.unsharded_param(fp), grad)
                    handoff_internals.set_unsharded_grad(fp, grad)
                handoff_internals.group_post_backward(groups[gi])
        if pending:  # cannot happen: every parameter's group was visited
            raise internals.FSDPInternalsError(
                f"{len(pending)} clipped gradient(s) were left undelivered"
            )
        with reduce_phase():
            handoff_internals.finish_backward(self.modules)

    @staticmethod
    def _groups_of(module: nn.Module, index: dict) -> set[int]:
        out = set()
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                if id(p) not in index:
                    raise handoff_internals.unmanaged_param_error(p)
                out.add(index[id(p)][0])
        return out


def _controller(modules: list[nn.Module], *, enabled: bool, keep_unsharded: bool = False, **_):
    if not enabled:
        return NullController()
    return FSDP2Controller(modules, keep_unsharded=keep_unsharded)


def _handoff(modules: list[nn.Module]) -> FSDP2Handoff:
    return FSDP2Handoff(modules)


def _sharded(inner, *, generator, secure_mode: bool, dp_degree: int, **kwargs):
    from ..optimizers import ShardedNoiseFSDPOptimizer

    logger.info("[Ghost] FSDP2: DP optimizer drawing noise for the local shard only")
    return ShardedNoiseFSDPOptimizer(
        inner, generator=generator, secure_mode=secure_mode, dp_degree=dp_degree, **kwargs
    )


def _opacus_fsdp(inner, *, generator, secure_mode: bool, dp_degree: int, **kwargs):
    from ..optimizers import DataParallelFSDPOptimizer

    return DataParallelFSDPOptimizer(
        inner, generator=generator, secure_mode=secure_mode, dp_degree=dp_degree, **kwargs
    )


def _plan_optimizer(modules, *, options, secure_mode: bool, grad_sample_mode: str, layout):
    """Shard-local noise with ``ghost_fsdp`` and the optimisation on; else Opacus's.

    Both divide by ``layout.dp_degree`` (:class:`~..distributed.layout.Layout`): under tensor
    parallelism FSDP2 averages over the data-parallel ranks only. Without it Opacus's own
    optimizer (None) already divides by the world size. Every call first refuses a
    reduction other than the average (:func:`check_reduction`).
    """
    checks.check_reduction(modules)
    if secure_mode:
        checks.refuse_secure_replicas(modules)
    if options.sync_optimization and not secure_mode and grad_sample_mode == "ghost_fsdp":
        return functools.partial(_sharded, dp_degree=layout.dp_degree)
    if layout.tensor_parallel:
        return functools.partial(_opacus_fsdp, dp_degree=layout.dp_degree)
    return None


RECORD = ApiRecord(
    name=FSDP2,
    title="FSDP2",
    # Opacus's "ghost" hooks count forwards on each nn.Parameter: FSDP2 swaps them for DTensors
    # and the first forward fails (AttributeError: '_forward_counter').
    capabilities=Capabilities(
        distributed=True, sharded=True, keep_unsharded=True, ghost_modes=("ghost_fsdp",)
    ),
    make_controller=_controller,
    make_handoff=_handoff,
    plan_optimizer=_plan_optimizer,
    check_layout=checks.check_layout,
    unsharded_bytes=internals.unsharded_bytes,
)
