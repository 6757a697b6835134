"""The ghost-clipping step: norm-only first backward without gradient sync, then the clipped one.

:class:`SyncDPTensor` is what the criterion returned by our ``make_private`` gives back; its
``backward()`` runs the two passes of Opacus's ``DPTensorFastGradientClipping.backward`` with the
distributed controller around the first pass and the timers around each phase.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from opacus.utils.fast_gradient_clipping_utils import (
    DPLossFastGradientClipping,
    DPTensorFastGradientClipping,
)

from ._opacus_internals import abandon_step, last_step_skipped, next_step_skipped
from .apis.api import GradientHandoff, StepController
from .apis.single import NullController
from .errors import UnsupportedConfigurationError, attach_cleanup_error
from .hooks.contract import StepHooks
from .hooks.ghost import step_hooks
from .hooks.kept import kept_bytes
from .layers.ownership import check_parameter_uses
from .one_backward.memory import MemoryBudget, MemoryPlan
from .optimizers.ops import DPOptimizerOps, OpacusOptimizerOps
from .profiling.memory import AllocatorWatch
from .profiling.timers import StepTimer, step_phase

logger = logging.getLogger(__name__)
logger_ghost = logging.getLogger("opacus_fsdp_sync")


@dataclass
class GhostStepContext:
    """What a step needs besides the loss: the sync controller and the phase timer."""

    controller: StepController = field(default_factory=NullController)
    timer: StepTimer = field(default_factory=StepTimer)
    restricted_first_pass: bool = False
    """Differentiate the first pass w.r.t. activations only (no weight gradients)."""
    handoff: GradientHandoff | None = None
    """With the restricted first pass: delivers clipped gradients computed from it (one
    backward per step); None runs the second backward."""
    fused_kernels: bool | None = None
    """The option of that name (:class:`~.options.GhostOptions`): clipped ``Linear`` gradients
    from the fused kernel with the coefficients folded in."""
    optimizer_ops: DPOptimizerOps = field(default_factory=lambda: OpacusOptimizerOps(None))
    """What the step asks of the DP optimizer (noise drawn ahead, gradients cleared to None)."""
    last_step_one_backward: bool | None = None
    """Whether the last completed step ran one backward (None before the first step): a step
    may fall back to two passes (no first-pass source, or a loss term outside the hooked
    layers)."""
    kept_bytes: int = 0
    """One backward: bytes of layer inputs and output gradients held from the first pass until
    the gradient phase, in the last step."""
    memory: MemoryBudget | None = None
    """Checks what one backward will keep against ``one_backward_memory_budget`` before each
    first pass (:mod:`.one_backward.memory`); None: no check."""
    allocator_watch: AllocatorWatch | None = None
    """On CUDA: says when the caching allocator retried allocations since the last step."""
    fallbacks: set[str] = field(default_factory=set)
    """Fallbacks already logged (each is logged once, as a warning)."""

    def fallback(self, why: str) -> None:
        """Logs, once per reason, that a step took a slower path than planned and why."""
        if why not in self.fallbacks:
            self.fallbacks.add(why)
            logger_ghost.warning("[Ghost] fallback: %s", why)


def _reduce(loss_per_sample: torch.Tensor, loss_reduction: str) -> torch.Tensor:
    if loss_reduction == "mean":
        return torch.mean(loss_per_sample, dim=0)
    if loss_reduction == "sum":
        return torch.sum(loss_per_sample, dim=0)
    raise ValueError(f"loss_reduction = {loss_reduction!r}. Only 'sum' and 'mean' are supported")


def _densify_sparse_grads(optimizer) -> None:
    """Makes a sparse gradient (``nn.Embedding(sparse=True)``'s second backward) dense.

    The noise makes every gradient dense anyway, and Opacus's optimizer adds it as
    ``summed_grad + noise``, which torch refuses for a sparse left operand. Same values.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and p.grad.layout is not torch.strided:
                p.grad = p.grad.to_dense()


def _check_sample_count(coeff: torch.Tensor, loss_per_sample: torch.Tensor) -> None:
    """Refuses clipping coefficients for another number of samples than the loss has.

    The hooks take a layer's first dimension for the samples. A layer that sees the batch
    merged with other dimensions (``x.reshape(B * T, d)`` before a ``Linear``) or not first
    (time-first inputs without ``batch_first=False``) gives a norm per row instead: the one
    backward would clip rows, not samples, without an error.

    Raises:
        ValueError: naming both counts and what to change.
    """
    if coeff.shape[0] != loss_per_sample.shape[0]:
        raise ValueError(
            f"opacus_fsdp_sync: the per-sample norms cover {coeff.shape[0]} rows but the loss "
            f"has {loss_per_sample.shape[0]} samples. A trainable layer sees the batch "
            "dimension merged with another (e.g. x.reshape(B * T, d) before a Linear) or not "
            "first (time-first inputs need batch_first=False in make_private). Keep the "
            "samples as the first, separate dimension of every trainable layer's input."
        )


@dataclass
class _StepPath:
    """What :meth:`SyncDPTensor._choose_path` decided for one step."""

    #: The first pass's sources (the hooked outputs it differentiates), until the pass runs.
    sources: list | None
    #: Whether the first pass computes activation gradients only.
    restricted: bool
    #: Whether the clipped gradients come from what the first pass kept (one backward).
    one: bool
    #: The memory plan checked before the pass (None: no budget).
    plan: MemoryPlan | None


class SyncDPTensor(DPTensorFastGradientClipping):
    """A per-sample loss whose ``backward()`` skips gradient sync in the norm-only pass.

    Arithmetic (``loss / k``, ``a + b``, ``-loss``, ...) returns a :class:`SyncDPTensor` carrying
    the same step context, exactly as upstream returns its own type.
    """

    def __init__(self, module, optimizer, loss_per_sample, loss_reduction="mean", *, context=None):
        super().__init__(module, optimizer, loss_per_sample, loss_reduction)
        self.context = context if context is not None else GhostStepContext()
        #: The criterion's per-sample losses combined here: the parameter-use check's graph.
        self.sample_losses: tuple[torch.Tensor, ...] = (loss_per_sample,)

    def _adopt(self, result: DPTensorFastGradientClipping, other=None) -> SyncDPTensor:
        if isinstance(other, torch.Tensor) and other.requires_grad:  # not a private loss
            error = UnsupportedConfigurationError(
                "opacus_fsdp_sync: the private loss was combined with a tensor that needs "
                "gradients (e.g. loss + reg). Its gradient would be scaled by the per-sample "
                "clipping coefficients, which depend on the data: one example could move the "
                "update by more than max_grad_norm, and the privacy guarantee would not hold. "
                "Put an L2 penalty in the optimizer (weight_decay, applied after the noise), "
                "add per-sample terms as another loss of the private criterion (loss_a + "
                "loss_b), or detach the term. This step's forward is dropped."
            )
            self._clean_up_failed_step(error, step_hooks(self.module))
            raise error
        out = SyncDPTensor(
            self.module,
            self.optimizer,
            result.loss_per_sample,
            result.loss_reduction,
            context=self.context,
        )
        more = other.sample_losses if isinstance(other, SyncDPTensor) else ()
        out.sample_losses = tuple({id(t): t for t in self.sample_losses + more}.values())
        return out

    def __truediv__(self, other):
        return self._adopt(super().__truediv__(other), other)

    def __mul__(self, other):
        return self._adopt(super().__mul__(other), other)

    def __rmul__(self, other):
        return self._adopt(super().__rmul__(other), other)

    def __add__(self, other):
        return self._adopt(super().__add__(other), other)

    def __radd__(self, other):
        return self._adopt(super().__radd__(other), other)

    def __sub__(self, other):
        return self._adopt(super().__sub__(other), other)

    def __rsub__(self, other):
        return self._adopt(super().__rsub__(other), other)

    def __neg__(self):
        return self._adopt(super().__neg__())

    def __float__(self) -> float:
        """``float(loss)``: the reduced loss, as ``loss.item()`` gives it."""
        return float(self.item())

    def backward(self) -> None:
        """Runs the private step's backward: the norm-only first pass, then the clipped gradients.

        Three steps: choose the path (:meth:`_choose_path`), run the first pass
        (:meth:`_first_pass`), then hand over the clipped gradients (:meth:`_clipped_pass`),
        from a second backward or, with the one-backward hand-off, straight from what the first
        pass kept. Gradient sync, FSDP state and Opacus hooks are restored even on error.

        With timing on, the physical batches of one draw (``BatchMemoryManager``: every step but
        the draw's last skipped) are timed as one step: their phases add up and are resolved
        after the draw's last backward, so that no physical batch waits for the device to read
        the previous one's CUDA events.

        Raises:
            ValueError: for a loss reduction other than ``"mean"`` or ``"sum"``.
        """
        hooks = step_hooks(self.module)
        reduced_loss = _reduce(self.loss_per_sample, self.loss_reduction)
        if not last_step_skipped(self.optimizer):  # a draw's physical batches: timed together
            self.context.timer.flush()  # previous step's CUDA events, if any were left pending
        if self.context.allocator_watch is not None:
            self.context.allocator_watch.check()
        check_parameter_uses(self, hooks)  # once per model: .layers.ownership
        path = self._choose_path(hooks)
        self._first_pass(reduced_loss, hooks, path)
        self._clipped_pass(hooks, one=path.one)
        self.context.last_step_one_backward = path.one
        if not next_step_skipped(self.optimizer):  # more physical batches of this draw to come
            self.context.timer.end_step()

    def _choose_path(self, hooks: StepHooks) -> _StepPath:
        """Which first pass and which hand-off this step takes; logs each fallback.

        Raises:
            RuntimeError: when the API needs an activations-only first pass and there is none.
        """
        sources = hooks.begin_step()
        restricted = self.context.restricted_first_pass and bool(sources)
        controller = self.context.controller
        if controller.requires_restricted and not restricted:
            hooks.abort()
            raise RuntimeError(
                f"opacus_fsdp_sync: this {controller.api} step found no first-pass source (no "
                "hooked layer whose inputs need no gradient), and the sync-skipping step for this "
                "API relies on an activations-only first pass. For DDP pass "
                "restricted_first_pass=False to PrivacyEngine; FSDP1 has no fallback (use FSDP2)."
            )
        if self.context.restricted_first_pass and not restricted:
            self.context.fallback(
                "no first-pass source (no hooked layer whose inputs need no gradient): the first "
                "backward computes weight gradients too, and the step takes two backward passes"
            )
        one = restricted and self.context.handoff is not None
        plan = None
        if one and self.context.memory is not None:
            try:  # before anything is kept; a collective when distributed
                plan = self.context.memory.plan(hooks)
            except BaseException as err:
                self._clean_up_failed_step(err, hooks)
                raise
            one = plan is None or not plan.two_pass
        return _StepPath(sources=sources, restricted=restricted, one=one, plan=plan)

    def _first_pass(self, reduced_loss: torch.Tensor, hooks: StepHooks, path: _StepPath) -> None:
        """The norm-only first backward; on error every part is cleaned up, then it re-raises."""
        controller, timer = self.context.controller, self.context.timer
        if path.plan is not None and path.one:
            hooks.begin_first_pass(
                keep=True, per_sample=path.plan.per_sample, headroom=path.plan.headroom
            )
        else:
            hooks.begin_first_pass(keep=path.one)
        sources, path.sources = path.sources, None  # held by the pass only
        first_error: BaseException | None = None
        try:
            with step_phase("first_backward", timer):
                controller.begin_first_pass()
                reduced_loss.backward(
                    inputs=sources if path.restricted else None, retain_graph=not path.one
                )
                hooks.finish_norms()
                if path.restricted:
                    hooks.check_all_reported()
        except BaseException as err:  # cleaned up below, then re-raised
            first_error = err
        del sources
        try:
            hooks.end_first_pass(completed=first_error is None, restricted=path.restricted)
        except BaseException as err:
            first_error = _first(first_error, err)
        try:
            with step_phase("re-enable_sync", timer):
                controller.end_first_pass()
        except BaseException as err:
            first_error = _first(first_error, err)
        if first_error is not None:
            try:  # cleaned up while the error is being handled, as the controllers expect
                raise first_error
            except BaseException:
                self._clean_up_failed_step(first_error, hooks)
                raise

    def _clipped_pass(self, hooks: StepHooks, *, one: bool) -> None:
        """The clipped gradients: from what the first pass kept (``one``) or a second backward."""
        try:
            # The noise is drawn from here on, while the clipped gradients are computed and
            # reduced: drawn during the first pass, it slowed that pass by 10 ms and the step by
            # about 3 ms on 2 ranks sharing 2 CPU cores (results/cpu-2cores-small-late-noise/).
            # Inside the try: a draw that fails to start cleans the step up as any failure here.
            self.context.optimizer_ops.prefetch_noise()
            # As upstream, drop what the first pass left; to None rather than zero-filled (FSDP
            # then assigns instead of adding to zeros) where our optimizer reads None as zeros,
            # so a parameter this step did not use still gets its noise.
            self.optimizer.zero_grad(set_to_none=self.context.optimizer_ops.accepts_none_grads)
            coeff = hooks.get_clipping_coef()
            _check_sample_count(coeff, self.loss_per_sample)
            if one:
                # No hook may fire here: the generic path re-runs layers on their kept inputs.
                hooks.disable_hooks()
                try:
                    self._deliver_clipped_gradients(coeff, hooks)
                finally:
                    hooks.enable_hooks()
            else:
                second = torch.sum(coeff.to(self.loss_per_sample.device) * self.loss_per_sample)
                hooks.disable_hooks()
                try:
                    with step_phase("second_backward", self.context.timer):
                        second.backward()
                finally:
                    hooks.enable_hooks()
                _densify_sparse_grads(self.optimizer)
        except BaseException as err:
            self._clean_up_failed_step(err, hooks)
            raise

    def _clean_up_failed_step(self, error: BaseException, hooks: StepHooks) -> None:
        """Drops everything a failed step left, every part even when an earlier part raises.

        FSDP state (``controller.abort``), what the hooks hold (``hooks.abort``: Opacus's
        per-step state, the first pass's sources), every gradient, and the step's skip signal
        and any sum kept from its draw's earlier physical batches (never released). A cleanup
        part that raises is logged and attached to ``error`` (as a note, and in
        ``error.cleanup_errors``): the user sees the step's own error, never a cleanup's.
        """
        parts = [
            self.context.controller.abort,
            hooks.abort,
            lambda: self.optimizer.original_optimizer.zero_grad(set_to_none=True),
            lambda: abandon_step(self.optimizer),  # its skip signal, a sum kept mid-draw
        ]
        for part in parts:
            try:
                part()
            except Exception as cleanup:  # noqa: BLE001 - reported with the step's own error
                attach_cleanup_error(error, cleanup)

    def _deliver_clipped_gradients(self, coeff: torch.Tensor, hooks: StepHooks) -> None:
        from .one_backward import clipped_gradients

        timer = self.context.timer
        kept = hooks.take_kept()
        held = kept_bytes(kept)
        if self.context.kept_bytes == 0:
            psg = sum(1 for _, inputs, _ in kept if inputs is None)
            logger_ghost.info(
                "[Ghost] one backward holds %.1f MiB of layer inputs, output gradients and "
                "per-sample gradients between the first pass and the gradient phase "
                "(%d layers from per-sample gradients, %d from their inputs and output gradients)",
                held / 2**20,
                psg,
                len(kept) - psg,
            )
        self.context.kept_bytes = held
        type_of = hooks.layer_type
        handoff = self.context.handoff

        def compute(entries: list) -> dict:
            with step_phase("weight_grads", timer):
                return clipped_gradients(
                    entries,
                    coeff,
                    self.loss_reduction,
                    type_of,
                    fused_kernels=self.context.fused_kernels,
                    sequence_group=hooks.sequence_group,
                )

        name = handoff.phase
        handoff.deliver(kept, compute, lambda: step_phase(name, timer))


def _first(first: BaseException | None, later: BaseException) -> BaseException:
    """The error to raise: the first one, with a later one attached to it."""
    if first is None:
        return later
    attach_cleanup_error(first, later)
    return first


class SyncDPLoss(DPLossFastGradientClipping):
    """Opacus's ghost-clipping loss wrapper, returning :class:`SyncDPTensor` losses."""

    def __init__(self, module, optimizer, criterion, loss_reduction="mean", *, context=None):
        super().__init__(module, optimizer, criterion, loss_reduction)
        self.context = context if context is not None else GhostStepContext()
        #: Set by the engine under Poisson sampling (:mod:`.empty_batch`): tells when the last
        #: forward ran on a stand-in for an empty batch.
        self.stand_in = None

    def __call__(self, *args, shape=None, **kwargs) -> SyncDPTensor:
        """Computes the per-sample loss exactly as upstream and wraps it for our backward.

        After a forward on an empty batch's stand-in, the loss is the stand-in's output times
        zero (one sample, zero gradient), whatever the (empty) targets.
        """
        if self.stand_in is not None and self.stand_in.take():
            pred = args[0] if args else next(iter(kwargs.values()))
            loss_per_sample = (pred.float().sum() * 0.0).reshape(1)
            reduction = self.loss_reduction
        else:
            upstream = super().__call__(*args, shape=shape, **kwargs)
            loss_per_sample, reduction = upstream.loss_per_sample, upstream.loss_reduction
        return SyncDPTensor(
            self.module, self.optimizer, loss_per_sample, reduction, context=self.context
        )
