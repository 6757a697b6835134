"""The contracts between the private step and a distributed API, and one record per API.

The step talks to three collaborators that come in one kind per API: the **step controller**
(gradient sync off and on around the norm-only first pass, reset after a failure), the
**gradient hand-off** (clipped gradients from the first pass into the API's reduction: the one
backward) and the **DP optimizer** (noise drawn ahead, gradients cleared to None, fresh noise
streams). Each is a :class:`typing.Protocol` with every method present; kinds with nothing to do
implement it as a no-op.

Each API (single device, DDP, FSDP1, FSDP2) lives in its own module of this package and
exports one frozen :class:`ApiRecord`: its name, what it can do, and how it builds its
controller, hand-off and optimizer and checks its layout. :func:`~.detect.detect_api` returns
the record of a model's API. A new API is a new record, not edits in the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import nn

from ..optimizers import SharedNoiseDPOptimizer

logger = logging.getLogger("opacus_fsdp_sync")

#: The names records carry (what :class:`~.detect.DistributedRoot` reports as ``api``).
SINGLE, DDP, FSDP1, FSDP2, TP = None, "ddp", "fsdp1", "fsdp2", "tp"

#: Opacus's ghost-clipping ``grad_sample_mode`` values (this package's step runs them).
GHOST_MODES = ("ghost", "ghost_fsdp")
#: Opacus's other modes (its own per-sample gradient paths, passed through unchanged).
OPACUS_MODES = ("hooks", "functorch", "ew", "no_op")
#: Upstream's other names for ghost clipping: each runs the ghost mode of the model's API (its
#: record's first ``ghost_modes``). ``ghost_tp`` is Opacus 1.6's tensor-parallel class; here
#: the tensor-parallel path is taken from the model's layout, whatever the mode's name.
GHOST_ALIASES = ("ghost_tp",)


@runtime_checkable
class StepController(Protocol):
    """Gradient synchronisation around the first pass of one private step."""

    api: str | None
    """The record's name."""
    requires_restricted: bool
    """The step cannot run unless the first pass is activations-only (it would sync)."""
    enabled_message: str
    """The ``[Ghost]`` line logged once when the controller is built ('' for none)."""

    def begin_first_pass(self) -> None:
        """Turns gradient sync off (or checks it can stay off) before the first backward."""

    def end_first_pass(self) -> None:
        """Drops what the first pass produced and restores the user's settings; always called."""

    def abort(self) -> None:
        """Resets the API after a failed backward or hand-off; never masks the step's error."""


@runtime_checkable
class GradientHandoff(Protocol):
    """Hands one step's clipped gradients to the API's reduction (the one-backward step)."""

    phase: str
    """The timer and collective-counter phase of the hand-off."""

    def deliver(
        self,
        kept: list,
        compute: Callable[[list], dict],
        reduce_phase: Callable[[], AbstractContextManager],
    ) -> None:
        """Computes the clipped gradients of ``kept`` (through ``compute``) and reduces them.

        Args:
            kept: The first pass's ``(module, inputs, grad_out)`` entries; emptied as they are
                used, so their memory goes as soon as possible.
            compute: Maps a list of entries to their clipped gradients,
                ``{(id(module), name): (module, name, gradient)}``.
            reduce_phase: A context manager factory timing the reduction.
        """


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What an API's step can do."""

    distributed: bool
    """Gradients are reduced over ranks (the expected batch and the noise are per world)."""
    sharded: bool = False
    """Each rank holds a shard of the gradients (FSDP1, FSDP2), not the full ones."""
    keep_unsharded: bool = False
    """Parameters can stay unsharded between the passes (FSDP2)."""
    generic_replay: bool = False
    """One backward can replay a layer without a direct gradient formula (full parameters)."""
    ghost_modes: tuple[str, ...]
    """The ghost-clipping ``grad_sample_mode`` values a model of this API can be made private
    with (the first is the one to name when another is refused)."""


#: ``factory(inner optimizer, *, generator, secure_mode, **Opacus's optimizer arguments)``
#: returns this package's DP optimizer for the call.
OptimizerFactory = Callable[..., object]


@dataclass(frozen=True, kw_only=True)
class ApiRecord:
    """One distributed API: its name, capabilities and builders.

    Every builder takes the API's outermost wrapped modules (what detection found) first.
    """

    name: str | None
    """``None`` (single device), ``"ddp"``, ``"fsdp1"``, ``"fsdp2"`` or ``"tp"`` (alone)."""
    title: str
    """How logs and errors name it."""
    capabilities: Capabilities
    make_controller: Callable[..., StepController]
    """``(modules, *, enabled, keep_unsharded, restricted) -> StepController``; raises
    :class:`~opacus_fsdp_sync.errors.UnsupportedConfigurationError` for layouts the step
    cannot run."""
    make_handoff: Callable[[list[nn.Module]], GradientHandoff]
    """The one-backward hand-off; raises ``OneBackwardUnavailable`` with the reason."""
    plan_optimizer: Callable[..., OptimizerFactory | None]
    """``(modules, *, options, secure_mode, grad_sample_mode, layout) -> factory or None``:
    this package's optimizer for the call, or None for Opacus's; raises for what cannot run.
    ``layout`` is the call's :class:`~..distributed.layout.Layout` (its data-parallel degree is
    the gradient divisor under tensor parallelism)."""
    check_layout: Callable[[nn.Module, list[nn.Module]], None]
    """``(model, modules)``: refuses a layout whose gradients or noise would differ between
    replicas (names the parameters and the fix)."""
    unsharded_bytes: Callable[[list[nn.Module]], int] | None = None
    """Bytes of parameters held unsharded between the passes (with ``keep_unsharded``)."""


class WholeStepHandoff:
    """A hand-off that computes every kept layer's gradients, then hands them over at once.

    Subclasses set :attr:`phase` and implement :meth:`hand`.
    """

    phase = "reduce_scatter"

    def deliver(
        self,
        kept: list,
        compute: Callable[[list], dict],
        reduce_phase: Callable[[], AbstractContextManager],
    ) -> None:
        """:meth:`hand` the clipped gradients of every kept entry (see :class:`GradientHandoff`)."""
        entries = list(kept)
        kept.clear()
        grads = compute(entries)
        del entries
        with reduce_phase():
            self.hand(grads)

    def hand(self, grads: dict) -> None:
        """Hands ``{(id(module), name): (module, name, gradient)}`` to the API."""
        raise NotImplementedError


def no_layout_check(model: nn.Module, modules: list[nn.Module]) -> None:
    """A layout that is always calibrated (single device, DDP at the top)."""


def opacus_optimizer(modules, **_) -> None:
    """Opacus's own DP optimizer for every call."""
    return None


def shared_noise_optimizer(inner, *, generator, secure_mode: bool, **kwargs):
    """For gradients that arrive averaged over replicas: no all-reduce, one shared noise draw.

    The plans that return it refuse ``secure_mode`` first (a shared pseudo-random draw).
    """
    logger.info("[Ghost] optimizer without all-reduce, one noise draw shared by all ranks")
    return SharedNoiseDPOptimizer(inner, generator=generator, secure_mode=secure_mode, **kwargs)
