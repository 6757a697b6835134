"""The name of the step phase currently running (forward, first_backward, ...).

The engine's backward and the profiling harness announce phases here; observers such as the
collective counter attribute what they see to :func:`current_phase` without being wired into
the engine.
"""

from __future__ import annotations

import contextlib
import contextvars

_CURRENT_PHASE: contextvars.ContextVar[str] = contextvars.ContextVar(
    "opacus_fsdp_sync_phase", default="other"
)

#: Phases of one ghost-clipping step, in order.
STEP_PHASES = ("forward", "first_backward", "re-enable_sync", "second_backward", "optimizer_step")

#: Every phase the timers report (the engine's and the profiling harness's), in step order, mapped
#: to the phase whose time includes it: ``"step"`` for a top-level phase (the top-level phases and
#: the untimed gaps between them make up the step), another phase's name for a phase timed inside
#: that one, ``None`` for a phase timed outside the step. A new timer gets a row here, so that
#: plots and tables neither drop it nor count it twice.
PHASE_PARENT: dict[str, str | None] = {
    "forward": "step",
    "backward": "step",  # the non-private step's single backward
    "first_backward": "step",
    "norms": "first_backward",  # the first pass's norm hooks (first_pass.py)
    "tied_norm": "norms",  # a shared weight's cross terms, inside the norm hook (tied/)
    "re-enable_sync": "step",
    "second_backward": "step",
    "weight_grads": "step",  # one backward: clipped gradients from what the first pass kept
    "reduce_scatter": "step",  # one backward's hand-off under FSDP2 and FSDP1
    "all_reduce": "step",  # one backward's hand-off under DDP
    "optimizer_step": "step",
    "sampling": None,  # the Poisson draw, split and collate, before the step's timer starts
    "norm_tuning": None,  # timing the norm candidates (norm_tuner.py), subtracted from the step
}


def current_phase() -> str:
    """Returns the innermost phase announced with :func:`phase`, or ``"other"``."""
    return _CURRENT_PHASE.get()


def phase(name: str) -> contextlib.AbstractContextManager:
    """Marks the code in the ``with`` block as belonging to phase ``name``.

    Args:
        name: Phase name, e.g. one of :data:`STEP_PHASES`.

    Returns:
        A context manager (a plain object, not a generator: the ``norms`` phase is announced
        once per layer and step).
    """
    return _Phase(name)


class _Phase:
    """What :func:`phase` returns: sets the current phase, and restores the previous one."""

    __slots__ = ("_name", "_token")

    def __init__(self, name: str) -> None:
        self._name = name
        self._token = None

    def __enter__(self) -> None:
        self._token = _CURRENT_PHASE.set(self._name)

    def __exit__(self, *exc) -> bool:
        _CURRENT_PHASE.reset(self._token)
        return False
